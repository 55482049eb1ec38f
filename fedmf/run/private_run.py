"""PrivateRun: the server side of one private run, round by round, framework-free.

It holds the plan, the ledger run, the scheduler, the privatizer, the server optimizer and the
checkpoint store, and exposes the round as the steps of ARCHITECTURE.md's data flow:

    run = PrivateRun.open(model, plan, "run/")         # new, or resumed after the last committed round
    run.guard()                                         # horizon and budget (raises to stop cleanly)
    selection = run.select(available_users)             # scheduler + ledger selection rows
    ...send the model to selection.reachable, collect their updates...
    report = run.aggregate(updates, rejected)           # validate, zero, clip, sum, noise, ÷ m, optimizer step
    record = run.commit()                               # checkpoint, then the ledger commit naming its hash
    ...only now release the model, metrics, evaluation...

Both drivers, ``fedmf.run.federated.train`` (in process) and the Flower strategy (``server/``), run
``fedmf.run.loop.run_rounds``, which makes these calls in this order. A round that was not
committed is redone with fresh noise (a new noise salt per attempt, fedmf.round.noise) and the same
selection when the same users are available (the scheduler's decisions are a deterministic
function of its state and the available set); the committed rounds resume bit-exactly (their
noise is reproduced from the checkpoint's salts). So a run directory restored from a backup
never releases a round again with the noise it was released with — and a resume is refused when
the run directory, the ledger and the release witness (``fedmf.run.witness``, appended after each
commit, before the release) disagree on the rounds committed (``_refuse_rollback``,
``_refuse_ledger_rollback``, ``_check_witness``). One server at a time: a
PrivateRun locks its directory (``run.lock``, flock) until it is closed or its process dies.
``repeatable_noise=True`` (tests only, unsafe) leaves the salts out: then the two drivers
produce bit-identical models for the same plan, secrets, users and (deterministic) local
updates, and a redone round repeats its noise.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError, FedmfError, RoundOrderError
from ..files import atomic_write, lock_directory
from ..participation import MinSep
from ..plan import RunPlan
from ..round.adaptive_clipping import adaptive_metrics
from ..round.client_metrics import RELEASED as CLIENT_METRIC_RELEASED
from ..round.privatize import RoundPrivatizer, RoundReport, layout_of, param_dtype
from ..secagg.secure_sum import SecureSum
from .checkpoint import CheckpointStore, RunSecrets
from .cohort import check as check_cohort
from .refused_start import RUN_FILE, entries, missing_dirs, remove_created
from .rollback import check_witness, refuse_ledger_rollback, refuse_rollback, resume_ledger_run
from .round_log import append_round, logged_rounds
from .witness import WITNESS_OFF, Witness

__all__ = ["PrivateRun", "RoundRecord", "EVENTS", "REPEATABLE_NOISE_ENV", "repeatable_noise_from_env", "NOISE_SALTS",
           "WITNESS_OFF", "RECOVERED_EVALUATED", "RECOVERED_UNEVALUATED"]

#: the points of a round at which ``on_event(event, t)`` is called (fault-injection tests use them)
EVENTS = ("guarded", "selected", "updates", "noised", "stepped", "checkpointed", "committed", "witnessed",
          "released")

#: set to 1 (tests only) to run the ServerApp and ``fedmf simulate`` without noise salts
REPEATABLE_NOISE_ENV = "FEDMF_UNSAFE_REPEATABLE_NOISE"
_UNSALTED = ("UNSAFE, for tests only: noise is not salted, so a redone round or a restored run directory releases "
             "a round again with the same noise")
#: the warning printed when it is set
REPEATABLE_NOISE_WARNING = f"{REPEATABLE_NOISE_ENV}=1: {_UNSALTED}"
#: run.json's "noise_salts": how the run's noise is keyed (an auditor of the directory sees the unsafe mode)
NOISE_SALTS = {False: "per-attempt", True: "repeatable-unsafe"}
log = logging.getLogger("fedmf")
#: a round log line written on a resume (``PrivateRun.record_missing``): what its metrics are
RECOVERED_EVALUATED = ("written on resume (the server stopped between the round's commit and its release): "
                       "evaluated then, from the round's checkpoint")
RECOVERED_UNEVALUATED = ("written on resume (the server stopped between the round's commit and its release): "
                         "no evaluation (only the last committed round's model is kept), no client metrics")
_WITNESS_OFF_WARNING = ("witness=off: UNSAFE, for tests only: a rollback of the ledger and the run directory together "
                        "is not detected, and would release rounds again")


def repeatable_noise_from_env() -> bool:
    """Whether ``FEDMF_UNSAFE_REPEATABLE_NOISE=1`` asks for unsalted noise (tests only)."""
    return os.environ.get(REPEATABLE_NOISE_ENV) == "1"


@dataclass
class RoundRecord:
    """What a committed round may release (no noise, no per-user data)."""

    round: int
    epsilon: float
    selected: int
    contributed: int
    dropped: int
    rejected: int
    clipped: int | None  # only in runs that record ledger diagnostics: data-dependent, outside the DP guarantee
    zeroed: int | None  # likewise (the clipped count is what adaptive clipping releases only with noise)
    seconds: float | None  # None: a record written on resume (PrivateRun.record_missing)
    checkpoint_bytes: int | None
    metrics: dict[str, float] = field(default_factory=dict)


class PrivateRun:
    """One private run of ``plan`` on ``model`` with its durable state in ``directory``."""

    def __init__(self, model, plan, directory, secrets, store, book, ledger_url, run, privatizer, optimizer,
                 scheduler, on_event, lock: int, witness: Witness | None = None,
                 resumed_from: int | None = None) -> None:
        self.model, self.plan, self.directory, self._lock = model, plan, directory, lock
        self._secrets, self.store, self._book, self.ledger_url = secrets, store, book, ledger_url
        self._run, self.privatizer, self.optimizer, self.scheduler = run, privatizer, optimizer, scheduler
        self._event = on_event or (lambda name, t: None)
        self._params = dict(model.named_parameters())
        self._selection = None
        self._report: RoundReport | None = None
        self._started = 0.0
        self._broken: str | None = None  # set when an aborted round's state could not be restored
        self._committed_record: RoundRecord | None = None  # the round committed and not yet released
        self._budget = None  # fedmf.budgets.RunBudget when the ledger enforces lifetime budgets
        self._missing_digests: dict[int, str] = {}  # missing_records → record_missing
        self._witness = witness  # None: off (tests only)
        #: the rounds committed before this process opened the run (None: a new run)
        self.resumed_from = resumed_from
        self.min_cohort: int | None = None  # the fewest users a round must be able to select (fedmf.run.cohort)
        self._population: int | None = None
        # the last committed checkpoint's hash, kept in memory so that an abort needs no database, and
        # the ledger's chain head (round, hash) there: what the summary asks to record elsewhere
        last = run.next_round - 1
        summary = run.round(last) if last >= 0 else None
        self._last_digest = (summary.checkpoint_sha256 if summary is not None
                             else json.loads((directory / RUN_FILE).read_text(encoding="utf-8"))["initial_sha256"])
        self._head = (last, summary.chain_sha256 if summary is not None else run.info.genesis_sha256)

    # ---- opening and closing -----------------------------------------------------------
    @classmethod
    def open(cls, model: torch.nn.Module, plan: RunPlan, directory: str | os.PathLike, *,
             ledger: str | os.PathLike | None = None, server_lr: float = 1.0, optimizer: str = "workload",
             population: Iterable[Hashable] | None = None, on_event: Callable[[str, int], None] | None = None,
             name: str | None = None, repeatable_noise: bool = False,
             ledger_diagnostics: bool = False, budget_key: str | os.PathLike | None = None,
             witness: str | os.PathLike | None = None,
             min_clients_per_round: int | None = None) -> PrivateRun:
        """Resume the run recorded in ``directory`` (restoring the last committed round's
        checkpoint; the plan must be the same) or start a new one. ``ledger``: a ledger URL
        (default: ``<directory>/ledger.db``). ``population``: the users, for schedulers that
        sample the whole population (required by the fixed-epoch order). ``repeatable_noise``:
        tests only (unsafe): no noise salts, so a redone round repeats its noise.
        ``ledger_diagnostics``: a new run also records each contribution's update norm and whether
        it was clipped (data-dependent, outside the DP guarantee; a resumed run keeps its own setting).
        A population smaller than the plan's expected users per round is refused
        (``RunPlan.check_population``). ``budget_key``: the ledger's budget secret file, required
        when the ledger enforces lifetime budgets (``fedmf.budgets``). ``witness``: the release
        witness's directory (``fedmf.run.witness``; None: the user's state directory; ``"off"``: none,
        tests only, unsafe). ``min_clients_per_round``: the fewest users a round must be able to select
        (None or 0: the default; ``fedmf.run.cohort``).

        A resume is refused (``CheckpointError``, one line) when the ledger and the run directory
        disagree on the rounds committed — either one is older than the other (restored from a
        backup) — or when both are behind the release witness: resuming would release rounds again."""
        from ..budgets import RunBudget
        from ..ledger import Ledger
        from ..ledger.budgets import load_budget_secret
        from ..round.server_optimizer import server_optimizer
        from ..schedule import make_scheduler
        from .cohort import resolve_min_cohort

        if not isinstance(plan, RunPlan):
            raise ConfigError(f"plan must be a RunPlan, got {type(plan).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if repeatable_noise is True:
            log.warning("fedmf: warning: repeatable_noise=True for the run in %s: %s", directory, _UNSALTED)
        if population is not None:
            population = list(population)
            plan.check_population(len(population))  # before anything is written
        min_cohort = resolve_min_cohort(plan, min_clients_per_round, None if population is None else len(population))
        directory = Path(directory)
        existed = entries(directory)  # a refused start removes what it created, and only that
        made = missing_dirs(directory)
        witness_off = witness is not None and os.fspath(witness) == WITNESS_OFF
        if witness_off:
            log.warning("fedmf: warning: %s", _WITNESS_OFF_WARNING)
        resumed = (directory / RUN_FILE).exists()
        witness_dir = None if witness_off else Witness.directory(witness)  # checked before anything is written
        store = CheckpointStore(directory, clean=False)  # another server's temporary files stay
        lock = lock_directory(directory, CheckpointError)  # held until close (or the process dies)
        try:
            secrets = RunSecrets(directory / "secrets")  # (a new secret is created O_EXCL: no race)
            store.clean()
            ledger_url = str(ledger) if ledger is not None else str(directory / "ledger.db")
            book = Ledger.open(ledger_url, secret=secrets.ledger_secret)
        except BaseException:
            remove_created(directory, existed, made)
            os.close(lock)
            raise
        try:
            params = dict(model.named_parameters())
            dtype, device = param_dtype(params)
            privatizer = RoundPrivatizer(plan, layout_of(params), device=device, dtype=dtype, seed=secrets.noise_seed,
                                         repeatable_noise=repeatable_noise)
            opt = server_optimizer(params, plan.mechanism.workload, plan.rounds, server_lr, kind=optimizer)
            users_per_round = None
            if not plan.sampling.amplified and isinstance(plan.schema, MinSep):
                if not float(plan.expected_users).is_integer():
                    raise ConfigError("without sampling, expected_users is the number of users picked per round: "
                                      f"an integer, got {plan.expected_users}")
                users_per_round = int(plan.expected_users)
            scheduler = make_scheduler(plan.schema, plan.sampling, key=secrets.schedule_key, rounds=plan.rounds,
                                       users_per_round=users_per_round,
                                       population=population)
            # before the run is recorded: a ledger with lifetime budgets refuses a run without their secret
            budget = RunBudget.open(book, None if budget_key is None else load_budget_secret(budget_key), plan)
            run, started_with_witness = cls._attach(book, directory, store, secrets, plan, model, privatizer, opt,
                                                    scheduler, name, NOISE_SALTS[repeatable_noise],
                                                    ledger_diagnostics, witness_dir)
            if budget is not None:
                budget.run_id = run.id
            committed = run.next_round
            if witness_off and started_with_witness:  # run.json: started with one; off would skip its check
                raise CheckpointError(f"run {run.id} was started with a release witness ({RUN_FILE} says so): it "
                                      "cannot be resumed with witness = \"off\", which would accept a rollback of "
                                      "both stores; resume it with its witness")
            record = None if witness_off else check_witness(
                Witness.open(witness_dir, run_id=run.id, genesis_sha256=run.info.genesis_sha256), run, committed - 1,
                started_with_witness)
        except BaseException:
            book.close()
            remove_created(directory, existed, made)
            os.close(lock)
            raise
        out = cls(model, plan, directory, secrets, store, book, ledger_url, run, privatizer, opt, scheduler, on_event,
                  lock, witness=record, resumed_from=committed if resumed else None)
        out._budget = budget
        out.min_cohort, out._population = min_cohort, None if population is None else len(population)
        return out

    @staticmethod
    def _attach(book, directory: Path, store: CheckpointStore, secrets: RunSecrets, plan: RunPlan, model, privatizer,
                optimizer, scheduler, name, noise_salts: str, diagnostics: bool, witness_dir: Path | None):
        """The ledger run of ``directory``, resumed or created (a new run's witness genesis line written
        before its run.json: ``witness_dir`` None, the witness off), and whether run.json says it was
        started with a witness (None: not recorded, a run of an older fedmf)."""
        run_file = directory / RUN_FILE
        seed_file = str(directory / "secrets" / "noise_seed")
        if run_file.exists():
            try:
                recorded = json.loads(run_file.read_text(encoding="utf-8"))
                run_id, fingerprint = int(recorded["run_id"]), recorded["plan_fingerprint"]
                initial_sha256 = str(recorded["initial_sha256"])
                binding = recorded.get("noise_seed_binding")  # absent: a run started before seeds were bound
            except (OSError, ValueError, KeyError, TypeError):
                raise ConfigError(f"{str(run_file)!r} is damaged") from None
            if binding is not None and (secrets.noise_seed_binding or b"").hex() != binding:
                raise CheckpointError(f"the noise seed in {seed_file!r} is not bound to the run {RUN_FILE} names: "
                                      "restore that run's own secrets/ to resume it")
            plan.check_fingerprint(fingerprint, f"checkpoint directory {str(directory)!r}")
            run = resume_ledger_run(book, run_id, directory)
            plan.check_fingerprint(run.info.plan_fingerprint, f"ledger run {run_id}")
            last = run.next_round - 1  # -1: the initial state, before round 0
            refuse_rollback(store, last)  # the run directory is older than the ledger
            refuse_ledger_rollback(directory, store, run, last)  # the ledger is older than the run directory
            digest = run.round(last).checkpoint_sha256 if last >= 0 else initial_sha256
            state = store.load(last, digest)
            plan.check_fingerprint(state.get("plan_fingerprint"), f"checkpoint of round {last}")
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            privatizer.load_state_dict(state["privatizer"])
            scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"]["torch"])
            if noise_salts == NOISE_SALTS[True] and recorded.get("noise_salts") != noise_salts:
                # once unsalted, always marked: the run's released rounds may repeat noise
                atomic_write(run_file, lambda f: json.dump({**recorded, "noise_salts": noise_salts}, f), text=True,
                             mode=0o600)
            started_with_witness = recorded.get("witness")
            return run, started_with_witness if isinstance(started_with_witness, bool) else None
        # one noise seed, one run: a second run with this seed would repeat released noise
        if secrets.noise_seed_binding is not None:
            raise CheckpointError(f"the noise seed in {seed_file!r} is bound to another run (copied from its run "
                                  f"directory?), or a start of a run here stopped before writing {RUN_FILE}: a new "
                                  "run needs new secrets (a new directory; or, if no round was ever committed from "
                                  "this directory, remove its secrets/ and initial.pt); noise is never reused")
        leftovers = sorted(p.name for p in directory.iterdir()
                           if p.name == "initial.pt" or p.name.startswith(("round-", "noise-")))
        used = directory / "secrets" / "noise_seed.used"
        if leftovers or used.exists():
            raise CheckpointError(f"{str(directory)!r} holds the state of an earlier run ({', '.join(leftovers[:3]) or used.name}) "
                                  f"but no {RUN_FILE}: restore {RUN_FILE} to resume it, or start a new run in a new "
                                  "directory (new secrets); noise is never reused")
        noise_check = privatizer.state_dict()["noise"]["seed_check"]
        for other in book.runs():
            if other.config.get("noise_key_check") == noise_check:
                raise CheckpointError(f"ledger run {other.id} was made with the noise seed in {str(directory)!r} and "
                                      f"{RUN_FILE} is missing: restore {RUN_FILE} to resume it, or start a new run "
                                      "in a new directory (new secrets); noise is never reused")
        binding = secrets.bind_noise_seed()  # before the seed's first use: a copy of the file carries it
        atomic_write(used, lambda f: f.write("a run was started with this noise seed; it is never used again\n"),
                     text=True, mode=0o600)
        initial_sha256 = store.save(-1, _state(plan, model, optimizer, privatizer, scheduler))
        run = book.create_run(plan.mechanism, noise_multiplier=plan.noise_multiplier, clip_norm=plan.clip_norm,
                              delta=plan.delta, target_epsilon=plan.target_epsilon, schema=plan.schema,
                              sampling=str(plan.sampling), name=name, plan=plan.to_dict(),
                              plan_fingerprint=plan.fingerprint, config={"noise_key_check": noise_check},
                              diagnostics=diagnostics)
        if witness_dir is not None:  # before run.json: a run that can be resumed has its genesis line
            Witness.open(witness_dir, run_id=run.id, genesis_sha256=run.info.genesis_sha256).begin()
        record = {"run_id": run.id, "noise_salts": noise_salts, "plan_fingerprint": plan.fingerprint,
                  "initial_sha256": initial_sha256, "noise_seed_binding": binding, "witness": witness_dir is not None}
        atomic_write(directory / RUN_FILE, lambda f: json.dump(record, f), text=True, mode=0o600)
        return run, witness_dir is not None

    def close(self) -> None:
        """Abort an open round, close the ledger and release the run directory's lock."""
        if self._lock is None:
            return
        try:
            if self._selection is not None:
                self.abort("the server stopped during the round")
        finally:
            try:
                self._book.close()
            finally:
                os.close(self._lock)
                self._lock = None

    def __enter__(self) -> PrivateRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- state -------------------------------------------------------------------------
    @property
    def run_id(self) -> int:
        return self._run.id

    @property
    def next_round(self) -> int:
        """The round to run next (one past the last committed round)."""
        return self.privatizer.next_round

    @property
    def head(self) -> tuple[int, str]:
        """(round, hash): the ledger's chain head at the last committed round (-1: the genesis), which an
        auditor records outside the ledger and checks with ``fedmf audit --verify --head ROUND:HASH``."""
        return self._head

    def resumed_line(self) -> str:
        """The line a resumed run logs: the round it goes on with and the rounds committed before
        (0-based, as the ledger and every other output number them)."""
        done, total = self.resumed_from or 0, self.plan.rounds
        before = f"rounds 0-{done - 1} of {total} were committed before" if done else "no round was committed before"
        if done >= total:
            return f"fedmf: resumed run {self.run_id} after its last round {total - 1}: {before}; no round left"
        return f"fedmf: resumed run {self.run_id} at round {done}: {before}"

    @property
    def witness_path(self) -> Path | None:
        """The release witness file (None: off)."""
        return None if self._witness is None else self._witness.path

    def user_key(self, user: Hashable) -> bytes:
        """The user's pseudonymous key in the ledger."""
        return self._run.key(user)

    def global_params(self) -> dict[str, torch.Tensor]:
        """A copy of the current (committed, hence releasable) model parameters."""
        self._check_usable()
        if self._selection is not None and self._report is not None:
            raise RoundOrderError("the model of an uncommitted round cannot be released")
        return {name: p.detach().clone() for name, p in self._params.items()}

    def observed_epsilon(self) -> float | None:
        """The worst user's ε over the committed rounds, accounted from the ledger's pattern."""
        from ..accounting.posthoc import account_observed

        observed = self._run.observed_pattern()
        if not observed.rounds_by_user:
            return None
        plan = self.plan
        return account_observed(plan.mechanism, plan.noise_multiplier, plan.delta, observed, plan.schema,
                                accountant=plan.accountant, count_noise_std=plan.extra_noise_std).epsilon

    # ---- the round ---------------------------------------------------------------------
    def guard(self, observed: bool = False) -> None:
        """Raise ``HorizonReached`` / ``PrivacyBudgetExceeded`` if the next round must not run
        (``observed``: also check the worst observed user's ε from the ledger)."""
        t = self.next_round
        self.plan.guard(t, self.observed_epsilon() if observed and t > 0 else None)
        self._event("guarded", t)

    def select(self, available: Iterable[Hashable]):
        """Decide who takes part in the next round, open it in the ledger and record the
        selection (amplified schemes: sampled users who are unreachable are dropouts). Raises
        ``CohortTooSmall`` before anything is decided or recorded when fewer than ``min_cohort``
        users can be selected (``fedmf.run.cohort``)."""
        self._check_usable()
        if self._selection is not None:
            raise RoundOrderError(f"round {self._selection.round} is still open")
        t = self.next_round
        self._started = time.perf_counter()
        available = list(available)
        offered = len(available)
        if self._budget is not None:  # users whose lifetime budget forbids this run are not available
            available = self._budget.admissible(t, available)
        # before the scheduler decides anything and before the ledger records anything (fedmf.run.cohort)
        check_cohort(t, self.min_cohort, self.scheduler, offered, available, rounds=self.plan.rounds,
                     budget_skipped=None if self._budget is None else self._budget.skipped,
                     population=self._population)
        selection = self.scheduler.select(t, available)
        self._selection, self._report = selection, None
        self._event("selected", t)
        try:
            self._run.open_round(t)
            accepted = self._run.record_selection(t, list(selection.selected))
            if len(accepted) != len(selection.selected):
                raise FedmfError(f"round {t}: the ledger refused users the scheduler selected (a plan mismatch)")
            if self._budget is not None:
                self._budget.charge(t, selection.reachable)
        except BaseException:
            self.abort("selection failed")  # restores the scheduler: the redo selects the same users
            raise
        return selection

    def aggregate(self, updates: Mapping[Hashable, Any], rejected: Mapping[Hashable, str] | None = None,
                  values: Mapping[Hashable, Any] | None = None) -> RoundReport:
        """Privatize the round's updates (summed in ``str(user)`` order) and step the model.
        ``rejected``: users whose reply was refused before it reached the engine (reason).
        ``values``: the users' reported training loss, read only by the plan's private client-metric
        release (``fedmf.round.client_metrics``). ``updates`` may instead be a ``SecureSum``
        (``fedmf.secagg.secure_sum``): the modular sum secure aggregation unmasked (noised, then decoded), privatized by
        ``RoundPrivatizer.privatize_sum``. Nothing of this round may be released before ``commit``."""
        selection = self._require_open()
        t = selection.round
        self._event("updates", t)
        try:
            if isinstance(updates, SecureSum):  # the clients' updates were summed by secure aggregation
                mean, report = self.privatizer.privatize_sum(
                    t, updates.words, updates.contributors, quantization=updates.quantization,
                    selected=selection.selected)
                rejected = {**updates.rejected, **(rejected or {})}
            else:
                mean, report = self.privatizer.privatize(t, updates, selected=selection.selected, values=values)
            self._event("noised", t)
            self.optimizer.step(mean)
            self._event("stepped", t)
            recorded: set[str] = set()
            for item in report.users:
                recorded.add(str(item.user))
                if item.status == "contributed":
                    self._run.record_contribution(t, item.user, update_norm=item.norm, clipped=item.clipped)
                else:
                    self._run.record_rejection(t, item.user, item.reason)
            for user, reason in (rejected or {}).items():
                if str(user) not in recorded:
                    recorded.add(str(user))
                    self._run.record_rejection(t, user, reason)
        except BaseException:
            self.abort("the round failed during aggregation")
            raise
        self._report = report
        return report

    def commit(self) -> RoundRecord:
        """Checkpoint, then commit the round in the ledger naming the checkpoint's hash. After
        this the round's model and metrics may be released."""
        selection = self._require_open()
        if self._report is None:
            raise RoundOrderError(f"round {selection.round} has not been aggregated")
        t = selection.round
        digest = None
        try:
            digest = self.store.save(t, _state(self.plan, self.model, self.optimizer, self.privatizer, self.scheduler))
            self._event("checkpointed", t)
            report = self._report
            summary = self._run.commit_round(t, noise_std=report.noise_std, epsilon_planned=self.plan.epsilon_after(t),
                                             checkpoint_sha256=digest, clip_norm=report.clip_norm,
                                             noisy_unclipped=report.noisy_unclipped)
        except FedmfError:
            # a lost connection during COMMIT leaves its outcome unknown: if the ledger did commit
            # round t (naming this checkpoint), the round is done — aborting it would put memory
            # one round behind the ledger
            summary = self._committed_anyway(t, digest)
            if summary is None:
                self.abort("the round failed while committing")
                raise
        except BaseException:
            self.abort("the round failed while committing")
            raise
        report, self._selection, self._report = self._report, None, None
        self._last_digest = digest
        self._head = (t, summary.chain_sha256)
        self._event("committed", t)
        if self._witness is not None:  # after the ledger commit, before anything of round t is released
            try:
                self._witness.append(t, summary.chain_sha256)
            except BaseException as e:
                # round t is committed but not witnessed: nothing of it may leave this process; a resume
                # records it in the witness before releasing anything
                self._broken = f"round {t} is committed but the release witness could not record it ({e})"
                raise
        self._event("witnessed", t)
        self.store.prune(keep=t)
        # clipped / zeroed leave only as diagnostics (outside the DP guarantee, like the ledger's norms): the
        # exact clipped count would undo adaptive clipping's noisy count
        counts = report.counts() if self._run.info.diagnostics else {"clipped": None, "zeroed": None}
        record = RoundRecord(t, self.plan.epsilon_after(t), summary.selected, summary.contributed, summary.dropped,
                             summary.rejected, counts["clipped"], counts["zeroed"],
                             time.perf_counter() - self._started, self.store.last_bytes)
        if report.clip_norm is not None:  # adaptive clipping: ζₜ and the released noisy fraction b̃ₜ/m
            record.metrics.update(adaptive_metrics(report.clip_norm, report.noisy_unclipped, self.plan.expected_users))
        if report.noisy_client_metric is not None:  # the private client-metric release (fedmf.round.client_metrics)
            record.metrics[CLIENT_METRIC_RELEASED] = report.noisy_client_metric
        self._committed_record = record
        return record

    def _committed_anyway(self, t: int, digest: str | None):
        if digest is None:
            return None
        try:
            return self._run.confirm_commit(t, digest)
        except FedmfError:
            return None  # the ledger cannot say (still down): abort; a restart resolves it from the ledger

    def released(self, t: int) -> None:
        """Mark round t's release: append the record ``commit`` returned for it — with the metrics the
        driver has added to it since (evaluation) — to the run's round log (``fedmf.run.round_log``), the
        durable source of ``results.json`` and ``progress.png``. Only the round just committed can be
        released (``RoundOrderError`` otherwise)."""
        record, self._committed_record = self._committed_record, None
        if record is None or record.round != t or self._selection is not None:
            raise RoundOrderError(f"round {t} is not the round just committed: it cannot be released")
        append_round(self.directory, self.run_id, self._last_digest, record)
        self._event("released", t)

    def missing_records(self) -> list[RoundRecord]:
        """The committed rounds that have no round log line (the server stopped between a round's
        commit and its release), in order, each as a ``RoundRecord`` rebuilt from the ledger's counts
        (no metrics but adaptive clipping's ζₜ and b̃ₜ/m, which the ledger keeps; no time, no size).
        Only the last of them can be evaluated: the model in memory is the last committed round's."""
        last = self.next_round - 1
        if self._selection is not None or self._committed_record is not None:
            raise RoundOrderError("missing records are looked for before a round opens")
        logged = logged_rounds(self.directory, self.run_id)
        records = []
        for t in (r for r in range(last + 1) if r not in logged):
            summary = self._run.round(t)
            record = RoundRecord(t, self.plan.epsilon_after(t), summary.selected, summary.contributed, summary.dropped,
                                 summary.rejected, summary.clipped if self._run.info.diagnostics else None, None,
                                 None, None)
            if summary.clip_norm is not None:
                record.metrics.update(adaptive_metrics(summary.clip_norm, summary.noisy_unclipped,
                                                       self.plan.expected_users))
            self._missing_digests[t] = summary.checkpoint_sha256
            records.append(record)
        return records

    def record_missing(self, record: RoundRecord, recovered: str) -> None:
        """Append a record ``missing_records`` returned (with the metrics the driver added: the last
        committed round's evaluation) to the round log, marked ``recovered`` (what its metrics are)."""
        self._check_usable()
        digest = self._missing_digests.pop(record.round, None)
        if digest is None:
            raise RoundOrderError(f"round {record.round} is not a committed round missing from the round log")
        append_round(self.directory, self.run_id, digest, record, recovered=recovered)

    def abort(self, reason: str) -> None:
        """Give up the open round: nothing of it was released, and the in-memory state is
        restored from the last committed checkpoint (bit-exactly), so the round can be redone —
        with the same selection when the same users are available, and fresh noise."""
        selection, self._selection, self._report = self._selection, None, None
        if selection is None:
            return
        self._broken = "an aborted round's state is being restored"  # until the restore completes
        self.privatizer.abort()
        self._abort_ledger(selection.round, reason)  # best effort: a database that is down leaves it open
        last = selection.round - 1
        try:
            state = self.store.load(last, self._last_digest)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.privatizer.load_state_dict(state["privatizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except BaseException as e:
            self._broken = f"restoring round {last}'s checkpoint failed ({type(e).__name__}); reopen the run"
            raise
        self._broken = None

    def _check_usable(self) -> None:
        if self._broken is not None:
            # the model in memory may hold an uncommitted round's noise: nothing may leave
            raise RoundOrderError(f"this run cannot continue: {self._broken}")

    def _abort_ledger(self, t: int, reason: str) -> None:
        try:
            self._run.abort_round(t, reason)
        except FedmfError:
            pass  # the round stays open; the next open_round takes it over as a new attempt

    def _require_open(self):
        if self._selection is None:
            raise RoundOrderError("no round is open: call select() first")
        return self._selection


def _state(plan: RunPlan, model, optimizer, privatizer, scheduler) -> dict[str, Any]:
    """Everything a resumed run needs, secrets excepted."""
    return {"plan_fingerprint": plan.fingerprint, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "privatizer": privatizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state()}}
