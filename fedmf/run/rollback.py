"""Release once across restores: a resume is refused when the run directory, the ledger and the
release witness disagree about which rounds were committed (and so released).

Each store is written in the round's order — checkpoint, ledger commit, witness line, release — so a
store behind another was restored from a backup, and resuming from it would release rounds again
(ARCHITECTURE.md, rule "release once")."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from .checkpoint import CheckpointStore, noise_file_rounds
from .round_log import logged_rounds
from .witness import GENESIS_ROUND, Witness

__all__ = ["refuse_rollback", "resume_ledger_run", "refuse_ledger_rollback", "check_witness"]



def refuse_rollback(store: CheckpointStore, committed: int) -> None:
    """A run directory older than the ledger's last committed (so released) round is a restored
    backup: resuming it would release rounds again. One line naming both rounds."""
    newest = max(store.rounds(), default=-1)
    if newest < committed:
        have = "only the initial state" if newest < 0 else f"round {newest}"
        raise CheckpointError(f"the ledger says round {committed} was committed and released, but "
                              f"{str(store.directory)!r} holds checkpoints up to {have}: a run directory older than "
                              "the ledger (a restored backup?) is never resumed, it would release those rounds again; "
                              "start a new run in a new directory")


def resume_ledger_run(book, run_id: int, directory: Path):
    """The ledger run ``run.json`` names; a ledger without it was rolled back to before the run
    began (or is another ledger): one line, since resuming would release the run's rounds again."""
    from ..ledger.db import LedgerError

    try:
        run = book.run(run_id)
    except LedgerError:
        if any(other.id == run_id for other in book.runs()):
            raise
        raise CheckpointError(f"the run directory {str(directory)!r} belongs to ledger run {run_id}, which the ledger "
                              "does not hold: the ledger was rolled back to before the run began (or is another "
                              "ledger); refusing to release rounds again") from None
    if not book.run_row_intact(run_id):  # the witness file is named by the stored genesis: an edit would empty it
        raise CheckpointError(f"ledger run {run_id}'s row does not match its stored genesis hash (the row or its "
                              "genesis_sha256 column was edited); refusing to resume it (`fedmf audit` names the change)")
    return run


def refuse_ledger_rollback(directory: Path, store: CheckpointStore, run, committed: int) -> None:
    """A ledger older than the run directory is a restored backup (or had rounds deleted): refused
    in one line naming both sides. The run directory shows round r committed when it holds a round
    log line of r (written after r's commit), or a checkpoint or noise file of r ≥ committed + 2 (a
    round is checkpointed only after the one before it was committed). A checkpoint or noise file of
    round committed + 1 is an attempt that a stop left uncommitted (redone with fresh noise: nothing
    of it was released) only if the ledger opened that round and round committed's checkpoint is still
    there (it is pruned after round committed + 1's commit); else the ledger lost it."""
    ledger_side = (f"the ledger's last committed round is {committed}" if committed >= 0
                   else "the ledger has no committed round")
    logged = logged_rounds(directory, run.id)
    ahead = [t for t in logged if t > committed]
    if ahead:
        raise CheckpointError(f"run directory {str(directory)!r} shows round {max(ahead)} committed (its round log "
                              f"rounds.jsonl) but {ledger_side} of run {run.id}: the ledger was rolled back; "
                              "refusing to release rounds again")
    if committed >= 0 and committed in logged and logged[committed] != run.round(committed).checkpoint_sha256:
        raise CheckpointError(f"run directory {str(directory)!r} logged round {committed} with another checkpoint than "
                              f"the ledger's commit of round {committed} names: the ledger was rolled back and the "
                              "round released again, or it is another ledger; refusing to go on")
    files = {t: f"checkpoint {store.path(t).name}" for t in store.rounds() if t > committed}
    for t, name in noise_file_rounds(directory):
        if t > committed and t not in files:
            files[t] = f"noise file {name}"
    if not files:
        return
    newest = max(files)
    if newest >= committed + 2:
        raise CheckpointError(f"run directory {str(directory)!r} shows round {newest - 1} committed (its "
                              f"{files[newest]} of round {newest}) but {ledger_side} of run {run.id}: the ledger "
                              "was rolled back; refusing to release rounds again")
    if run.round(newest).status not in ("open", "aborted"):
        raise CheckpointError(f"run directory {str(directory)!r} shows round {newest} begun (its {files[newest]}) but "
                              f"{ledger_side} of run {run.id} and it never opened round {newest}: the ledger was "
                              "rolled back; refusing to release rounds again")
    if committed >= 0 and newest in files and files[newest].startswith("checkpoint") and \
            not store.path(committed).exists():
        # round committed's checkpoint is pruned only after round newest's commit and witness line
        raise CheckpointError(f"run directory {str(directory)!r} shows round {newest} committed (its checkpoint "
                              f"{store.path(newest).name} without round {committed}'s, which is removed only after "
                              f"round {newest}'s commit) but {ledger_side} of run {run.id}: the ledger was rolled "
                              "back; refusing to release rounds again")


def check_witness(witness: Witness, run, committed: int, started_with_witness: bool | None = True) -> Witness:
    """Refuse (one line) a missing or empty witness (every run's file holds its genesis line from its
    creation on; ``started_with_witness``, what run.json says: False, a run started with the witness
    off; None, not recorded), a ledger behind the release witness, or whose chain head at the
    witness's last round is another one, or a witness two or more rounds behind the ledger (it is
    written after every commit and before any release: a changed or lost witness directory, which
    would accept a rollback of both stores); then bring a witness one round behind (a stop between a
    commit and its witness entry: that round was never released) up to the ledger's last round,
    before anything is released. Returns ``witness``."""
    last = witness.last()
    if last is None:  # not even the genesis line: another file than the one written at the run's creation
        if started_with_witness is False:
            raise CheckpointError(f"run {run.id} was started with witness = \"off\" (tests only), so it has no release "
                                  "witness and cannot be resumed with one: resume it with the witness off, or start "
                                  "a new run in a new directory")
        off = "" if started_with_witness else " (or the run was started with witness = \"off\")"
        raise CheckpointError(f"the release witness {str(witness.path)!r} of run {run.id} is missing or empty, but it "
                              "is written when a run is created: the witness directory changed (another witness "
                              "setting, HOME or XDG_STATE_HOME), the witness was lost, or the run's ledger row was "
                              f"edited (its genesis names the file){off}, and both stores may have been rolled back; "
                              "to move a witness, copy the run's witness file into this directory (deploy/README.md, "
                              "'The release witness'); refusing to release rounds again")
    ledger_side = (f"the ledger's last committed round is {committed}" if committed >= 0
                   else "the ledger has no committed round")
    if last.round > committed:
        raise CheckpointError(f"the release witness {str(witness.path)!r} shows round {last.round} committed but "
                              f"{ledger_side} of run {run.id} (and the run directory agrees with the ledger): "
                              "both were rolled back (restored from a backup?); refusing to release rounds again")
    head = run.info.genesis_sha256 if last.round == GENESIS_ROUND else run.round(last.round).chain_sha256
    if head != last.chain_sha256:
        raise CheckpointError(f"the release witness {str(witness.path)!r} records chain head "
                              f"{last.chain_sha256[:16]}… at round {last.round}, but the ledger's round "
                              f"{last.round} of run {run.id} has {str(head)[:16]}…: the ledger was rewritten or "
                              "rolled back and its rounds released again; refusing to go on")
    behind = committed - last.round
    if behind >= 2:  # a witness line is written after each commit, before any release: at most 1 behind
        recorded = "only the run's creation" if last.round == GENESIS_ROUND else f"up to round {last.round}"
        raise CheckpointError(f"the release witness {str(witness.path)!r} recorded {recorded} but the ledger has "
                              f"committed up to round {committed} of run {run.id}: the run went on in another witness "
                              "directory (copy that witness file here) or with the witness off, or this witness is "
                              "an older copy, and both stores may have been rolled back; refusing to release rounds "
                              "again")
    if behind == 1:  # a stop between round committed's commit and its witness line: never released
        witness.append(committed, run.round(committed).chain_sha256)
    return witness
