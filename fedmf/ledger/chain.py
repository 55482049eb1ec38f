"""The ledger's hash chain: what lets an auditor detect a rewritten history.

The run row is the genesis; each committed round's record commits to the previous round's
hash and to all of its participations, so an edited, deleted, moved or forged row changes
the hash of its round and of every later round. The encoding (version 1) is fixed here and
in deploy/README.md ("The hash chain"):

    field   := 'N'                                   None
             | 'I' int64 big-endian                  integer (a boolean as 0 / 1)
             | 'F' IEEE-754 binary64 big-endian      float (exact: the database stores binary64)
             | 'S' uint32 big-endian length, UTF-8   text; JSON as canonical JSON (sorted keys, no spaces, ASCII)
             | 'B' uint32 big-endian length, bytes   bytes
    genesis  = SHA-256("fedmf-ledger/v1/run\\0"   ‖ the run's GENESIS_FIELDS, in order)
    round_t  = SHA-256("fedmf-ledger/v1/round\\0" ‖ B(previous hash) ‖ the round's ROUND_FIELDS, in order
                       ‖ I(number of participations) ‖ for each, sorted by client key:
                         B(client_key) S(status) S(reason) or N)

                       ‖ for each of OPTIONAL_ROUND_FIELDS that is not None: S(name) F(value)

The optional fields (adaptive clipping's ζₜ and noisy count) enter only when set, so the hash of a
round without them is the one version 1 always gave. The previous hash of round 0 is the genesis; hashes are stored as 64 lowercase hex digits
(``runs.genesis_sha256``, ``rounds.chain_sha256``). Timestamps and diagnostics (update
norms) are not covered: accounting reads neither. The mechanism document enters as its
SHA-256 digest.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GENESIS_FIELDS", "ROUND_FIELDS", "OPTIONAL_ROUND_FIELDS", "genesis_sha256", "round_sha256", "ChainCheck",
           "check_chain", "HeadCheck", "check_head", "parse_head"]

_RUN_LABEL = b"fedmf-ledger/v1/run\x00"
_ROUND_LABEL = b"fedmf-ledger/v1/round\x00"

#: (column, kind) of the run row in the order the genesis hashes them
GENESIS_FIELDS: tuple[tuple[str, str], ...] = (
    ("uid", "str"), ("name", "str"), ("code_version", "str"), ("config", "json"), ("mechanism_kind", "str"),
    ("mechanism_checksum", "str"), ("mechanism_document", "digest"), ("rounds", "int"),
    ("noise_multiplier", "float"), ("clip_norm", "float"), ("delta", "float"), ("target_epsilon", "float"),
    ("participation_schema", "json"), ("sampling", "str"), ("key_check", "str"), ("plan", "json"),
    ("plan_fingerprint", "str"), ("diagnostics", "int"),
)
#: (column, kind) of a committed round's record in the order its hash takes them
ROUND_FIELDS: tuple[tuple[str, str], ...] = (
    ("round_index", "int"), ("status", "str"), ("attempts", "int"), ("selected", "int"), ("contributed", "int"),
    ("dropped", "int"), ("rejected", "int"), ("noise_std", "float"), ("epsilon_worst_user", "float"),
    ("epsilon_planned", "float"), ("checkpoint_sha256", "str"),
)

#: (column, kind) of a round's record hashed after ROUND_FIELDS, each only when it is not None
OPTIONAL_ROUND_FIELDS: tuple[tuple[str, str], ...] = (("clip_norm", "float"), ("noisy_unclipped", "float"))


def _field(kind: str, value: Any) -> bytes:
    if value is None:
        return b"N"
    if kind == "int":
        return b"I" + struct.pack(">q", int(value))
    if kind == "float":
        return b"F" + struct.pack(">d", float(value))
    if kind == "json":
        kind, value = "str", json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                                        allow_nan=False)
    if kind == "digest":
        kind, value = "bytes", hashlib.sha256(str(value).encode("utf-8")).digest()
    if kind == "str":
        data = str(value).encode("utf-8")
        return b"S" + struct.pack(">I", len(data)) + data
    if kind == "bytes":
        data = bytes(value)
        return b"B" + struct.pack(">I", len(data)) + data
    raise RuntimeError(f"unknown field kind {kind!r}")  # the fields are fixed in code: a bug


def genesis_sha256(run: Mapping[str, Any]) -> str:
    """The genesis hash (hex) of a run row given as a mapping of its columns."""
    h = hashlib.sha256(_RUN_LABEL)
    for name, kind in GENESIS_FIELDS:
        h.update(_field(kind, run[name]))
    return h.hexdigest()


def round_sha256(previous: str, record: Mapping[str, Any],
                 participations: Iterable[tuple[bytes, str, str | None]]) -> str:
    """Round t's hash (hex): ``previous`` (hex) is round t-1's hash, or the genesis for round 0;
    ``participations`` are (client_key, status, reason) in any order (sorted here)."""
    rows = sorted((bytes(k), s, r) for k, s, r in participations)
    h = hashlib.sha256(_ROUND_LABEL)
    h.update(_field("bytes", bytes.fromhex(previous)))
    for name, kind in ROUND_FIELDS:
        h.update(_field(kind, record[name]))
    for name, kind in OPTIONAL_ROUND_FIELDS:
        if record.get(name) is not None:
            h.update(_field("str", name) + _field(kind, record[name]))
    h.update(_field("int", len(rows)))
    for key, status, reason in rows:
        h.update(_field("bytes", key) + _field("str", status) + _field("str", reason))
    return h.hexdigest()


@dataclass(frozen=True)
class ChainCheck:
    """The outcome of ``check_chain``: ``first_bad_round`` is None with ``ok``; -1 means the run
    row (the genesis) itself."""

    ok: bool
    rounds_verified: int
    head_round: int | None
    head_sha256: str | None
    genesis_sha256: str
    first_bad_round: int | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "rounds_verified": self.rounds_verified, "head_round": self.head_round,
                "head_sha256": self.head_sha256, "genesis_sha256": self.genesis_sha256,
                "first_bad_round": self.first_bad_round, "reason": self.reason}


def check_chain(run: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]],
                participations: Iterable[tuple[int, bytes, str, str | None]],
                marked_committed: Iterable[int] = ()) -> ChainCheck:
    """Recompute a run's chain from its rows and name the first round that does not match.

    ``rounds``: the committed round records sorted by round; ``participations``: every
    participation row as (round, client_key, status, reason), sorted by round (streamed: one
    round in memory at a time); ``marked_committed``: rounds the mutable round state says were
    committed (a record missing at the end of the history shows only there)."""
    genesis = genesis_sha256(run)
    problems: list[tuple[int, str]] = []
    if run.get("genesis_sha256") != genesis:
        problems.append((-1, "the run row does not match its genesis hash (the run's plan or mechanism was changed)"))
    recorded = {int(r["round_index"]) for r in rounds}
    rows = iter(participations)
    pending = next(rows, None)
    previous, expected, verified, head, broken = genesis, 0, 0, (None, None), False
    for record in rounds:
        t = int(record["round_index"])
        mine = []
        while pending is not None and int(pending[0]) <= t:
            if int(pending[0]) == t:
                mine.append(tuple(pending[1:]))
            elif int(pending[0]) not in recorded:
                problems.append((int(pending[0]), f"round {pending[0]} has participations but no committed record"))
            pending = next(rows, None)
        if broken:
            continue
        if t != expected:
            problems.append((expected, f"round {expected} has no committed record but round {t} has"))
            broken = True
            continue
        computed = round_sha256(previous, record, mine)
        if record.get("chain_sha256") != computed:
            problems.append((t, f"round {t} does not match its hash (its record or participations were changed, "
                                "or it was not written by the server)"))
            broken = True
            continue
        previous, expected, verified, head = computed, t + 1, verified + 1, (t, computed)
    while pending is not None:
        if int(pending[0]) not in recorded:
            problems.append((int(pending[0]), f"round {pending[0]} has participations but no committed record"))
        pending = next(rows, None)
    for t in sorted(set(marked_committed) - recorded):
        problems.append((t, f"round {t} was committed but its record is missing"))
    if not problems:
        return ChainCheck(True, verified, head[0], head[1], genesis)
    first, reason = min(problems, key=lambda p: p[0])
    return ChainCheck(False, verified, head[0], head[1], genesis, first, reason)


def parse_head(text: str) -> tuple[int | None, str]:
    """``ROUND:HASH`` or ``HASH`` (64 hex digits; ROUND ≥ -1, -1 being the genesis) → (round or None,
    hash in lowercase); ``ValueError`` (one line) otherwise."""
    round_text, _, digest = str(text).strip().rpartition(":")
    digest = digest.lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"a recorded head is ROUND:HASH or HASH with 64 hex digits, got {text!r}")
    if not round_text:
        return None, digest
    try:
        t = int(round_text)
    except ValueError:
        raise ValueError(f"a recorded head's ROUND is an integer >= -1, got {round_text!r}") from None
    if t < -1:
        raise ValueError(f"a recorded head's ROUND is an integer >= -1, got {t}")
    return t, digest


@dataclass(frozen=True)
class HeadCheck:
    """The outcome of ``check_head``: ``round`` is the round the recorded head belongs to (None: not
    found), ``last_round`` the ledger's last committed round (-1: none), ``truncated`` whether the
    ledger ends before the recorded round."""

    ok: bool
    recorded: str
    round: int | None
    last_round: int
    truncated: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "recorded": self.recorded, "round": self.round, "last_round": self.last_round,
                "truncated": self.truncated, "reason": self.reason}


def check_head(chain: ChainCheck, rounds: Sequence[Mapping[str, Any]], recorded_round: int | None,
               recorded_sha256: str) -> HeadCheck:
    """Check a chain head an auditor recorded outside the ledger (``fedmf audit --verify --head``).

    It holds iff the recorded hash is the stored chain head of a committed round r (the genesis for
    r = -1; r = ``recorded_round`` when given) and the chain recomputed from the rows verifies through
    round r (``chain``, from ``check_chain`` over the same rows): the ledger then holds, unchanged, the
    history that was recorded. Rounds after r are not covered by the recorded head. It fails when the
    ledger ends before r (``truncated``), when round r's head is another hash (rewritten), when no
    round has the recorded hash, or when the chain does not verify through r."""
    stored = {int(r["round_index"]): r.get("chain_sha256") for r in rounds}
    last = max(stored, default=-1)
    label = recorded_sha256 if recorded_round is None else f"{recorded_round}:{recorded_sha256}"

    def fail(t: int | None, truncated: bool, reason: str) -> HeadCheck:
        return HeadCheck(False, label, t, last, truncated, reason)

    t = recorded_round
    if t is None:
        t = -1 if recorded_sha256 == chain.genesis_sha256 else next(
            (r for r, h in sorted(stored.items()) if h == recorded_sha256), None)
        if t is None:
            return fail(None, False, f"no committed round of the ledger (last {last}) has the recorded head: the "
                                     "ledger was rewritten, or truncated before the round it was recorded at (give "
                                     "ROUND:HASH to tell which)")
    if t > last:
        return fail(t, True, f"the ledger is truncated: its last committed round is {last}, before the recorded "
                             f"round {t}")
    have = chain.genesis_sha256 if t == -1 else stored.get(t)
    if have != recorded_sha256:
        return fail(t, False, f"the ledger was rewritten: {'its genesis' if t == -1 else f'round {t}'} has head "
                              f"{have}, not the recorded {recorded_sha256}")
    if chain.first_bad_round is not None and chain.first_bad_round <= max(t, 0) or \
            (t >= 0 and (chain.head_round is None or chain.head_round < t)):
        return fail(t, False, f"the chain does not verify through round {t}: {chain.reason}")
    after = last - t
    return HeadCheck(True, label, t, last, False, f"the recorded head is {'the genesis' if t == -1 else f'round {t}'}"
                     f"'s and the chain verifies through it; {after} later round{'s' if after != 1 else ''} not "
                     "covered by it")
