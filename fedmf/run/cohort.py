"""The cohort rule: no round is played as a release of noise alone because too few users could take part.

``min-clients-per-round`` (``--min-clients-per-round``; 0: the default below) is the fewest users a
round must be able to select. ``PrivateRun.select`` checks it (``check``) after the lifetime budgets
have passed over the users without room and BEFORE the scheduler decides the round: when too few are
eligible, it raises ``CohortTooSmall`` and nothing of the round exists — no ledger row, no budget
charge, no noise drawn, the scheduler's state unchanged. In process (``fedmf simulate``,
``fedmf.run.federated.train``) the run then ends with that one line; a deployment's server
(``server/strategy.py``) waits for users, polling, and stops with the line if the wait runs out.
Resumed later (budgets raised, users back), the run goes on from that round, exactly.

Which samplers it applies to, and why that keeps the guarantee (ARCHITECTURE.md rule 3):

* Sampling ``none`` (un-amplified): the accountant charges every user the worst participation
  pattern the schema allows (MinSep(b, k) or FixedEpoch(k, b)) and credits nothing to the selection's
  randomness. Whether round t is played is decided from counts that depend on no user's data — who is
  connected, whose lifetime budget has room, whom the schema still allows — before the round's
  selection, noise or anything else exists. A round not played releases nothing; the rounds played are
  rounds of the planned mechanism with selections the schema allows, and a run that stops after t
  rounds has spent ε after t rounds of the plan's curve (the observed accounting from the ledger stays
  exact). A selected user who then drops out still counts as selected: the rule counts who can be
  selected, never who replies. Defaults: min-sep schema (a fixed-size uniform sample of
  ``clients-per-round`` users): ``clients-per-round``, the planned size — a smaller round is not the
  run that was planned (its sum is still divided by the planned users, rule 2, so its update shrinks)
  and, in a deployment, waiting for the planned cohort is what Flower's own minimum of nodes does;
  fixed-epoch schema (the order fixes each round's slot of users; the slot's members that cannot take
  part are dropouts): 1, so that only a round nobody of the slot can join is refused.
* Amplified samplers (``poisson:P``, ``cyclic-poisson:Q``, ``bminsep:P``): their ε relies on each
  round's sample being drawn exactly as the accountant assumes, empty and small samples included.
  Refusing or redrawing a small sample would make the rounds played depend on the sample's size, which
  depends on whether a given user was sampled: not the distribution accounted. Their rounds are played
  as drawn (an explicit ``min-clients-per-round`` is refused), and ``counts`` reports how many had no
  contribution or fewer than the expected users.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from ..errors import CohortTooSmall, ConfigError

__all__ = ["NO_MINIMUM", "resolve_min_cohort", "check", "counts", "summary_line"]


#: ``min_clients_per_round=NO_MINIMUM`` (the engine's API only, never a user's setting): every round is
#: played however few users can join it — for the canary audit (``fedmf.audit.empirical``), which
#: measures the mechanism as it runs, small and empty rounds included (the guarantee holds for any cohort)
NO_MINIMUM = "no-minimum"


def resolve_min_cohort(plan, configured: int | str | None, population: int | None = None) -> int | None:
    """The minimum cohort a run enforces (None: none — the sampler keeps every round, amplified, or
    ``NO_MINIMUM``) from the configured ``min-clients-per-round`` (None or 0: the default, module
    docstring); a one-line ``ConfigError`` when it can never be met or does not apply."""
    from ..participation import FixedEpoch

    if configured == NO_MINIMUM:
        return None
    if configured is not None and (isinstance(configured, bool) or not isinstance(configured, int)
                                   or configured < 0):
        raise ConfigError(f"min-clients-per-round must be an integer >= 0 (0: the default), got {configured!r}")
    configured = configured or None
    if plan.sampling.amplified:
        if configured is not None:
            raise ConfigError(f"min-clients-per-round applies to sampling none (a fixed-size selection); "
                              f"sampling {plan.sampling} keeps the rounds it draws, small or empty (its accountant "
                              "assumes them): set it to 0")
        return None
    if isinstance(plan.schema, FixedEpoch):
        if configured is not None and population is not None and configured > population // plan.schema.min_sep:
            raise ConfigError(f"min-clients-per-round {configured} exceeds the smallest fixed-epoch slot "
                              f"({population} users / min-sep {plan.schema.min_sep}): no round could be played")
        return configured or 1
    planned = int(plan.expected_users)
    if configured is not None and configured > planned:
        raise ConfigError(f"min-clients-per-round {configured} exceeds clients-per-round {planned}: no round "
                          "could be filled")
    return configured or planned


def check(t: int, need: int | None, scheduler, offered: int, admitted: Sequence[Hashable], *,
          budget_skipped: int | None, population: int | None, rounds: int) -> None:
    """Raise ``CohortTooSmall`` (one line: eligible vs needed, and why the others are not) when fewer
    than ``need`` of the ``admitted`` users (those of the ``offered`` available ones whose budget has
    room) can be selected in round t. Decides nothing: the scheduler's state is not touched."""
    if need is None:
        return
    eligible = scheduler.eligible(t, admitted)
    if eligible is None or eligible >= need:
        return
    why = []
    if budget_skipped:
        why.append(f"{budget_skipped} of {offered} users have no budget left for this run")
    held = len(admitted) - eligible
    describe = scheduler.describe()
    if held > 0 and describe.get("scheme") == "min-sep":
        k = describe.get("max_participations")
        why.append(f"{held} took part in the last {describe['min_sep'] - 1} rounds"
                   + ("" if k is None else f" or {k} times already") + f" (min-sep {describe['min_sep']}"
                   + ("" if k is None else f", max-participations {k}") + ")")
    if population is not None and offered < population:
        why.append(f"{population - offered} of {population} are not connected")
    remedies = (["raise the users' budgets (fedmf budget)"] if budget_skipped else []) \
        + (["connect more users"] if population is not None and offered < population else [])
    raise CohortTooSmall(f"round {t} ({t}/{rounds} done) not played: {eligible} users can take part, "
                         f"{need} needed (min-clients-per-round)" + (f": {', '.join(why)}" if why else "")
                         + f"; nothing of it was recorded or released. To go on, {' or '.join(remedies + [''])}"
                         "lower min-clients-per-round, and resume the run")


def counts(history: Sequence[dict[str, Any]], plan, min_cohort: int | None) -> dict[str, Any]:
    """``results.json``'s ``cohorts``: of the committed rounds (``history``: dicts with ``contributed``),
    how many had no contribution (noise only), fewer than the plan's expected users, the fewest, the
    minimum cohort enforced (None: the sampler keeps every round) and the sampling."""
    expected_users = plan.expected_users
    contributed = [int(h["contributed"]) for h in history if h.get("contributed") is not None]
    return {"rounds": len(contributed), "no_contribution": sum(c == 0 for c in contributed),
            "below_expected": sum(c < expected_users for c in contributed), "expected_users": expected_users,
            "fewest": min(contributed, default=None), "min_clients_per_round": min_cohort,
            "sampling": str(plan.sampling)}


def summary_line(cohorts: dict[str, Any]) -> str:
    """One line for the summary: the rounds without contribution or below the expected users."""
    n, empty, below = cohorts["rounds"], cohorts["no_contribution"], cohorts["below_expected"]
    if not n:
        return "no round committed"
    expected = f"{cohorts['expected_users']:g}"
    text = (f"{empty} of {n} rounds had no contribution (noise only), {below} fewer than the {expected} expected "
            f"users (fewest {cohorts['fewest']})")
    if cohorts["min_clients_per_round"] is None:
        return text + f"; sampling {cohorts['sampling']} draws them (its accountant assumes them)"
    return text + f"; min-clients-per-round {cohorts['min_clients_per_round']} (below it: dropouts after selection)"
