"""Privacy accounting for fedmf runs.

* ``gaussian``        one Gaussian mechanism: epsilon(delta), calibration (cached)
* ``accountant``      epsilon / calibrate / epsilon_by_round for a mechanism, schema and sampling
* ``schemes``         how each sampling scheme (``fedmf.sampling``: none, bminsep, cyclic-poisson, poisson)
                      is accounted: one entry per scheme
* ``per_round``       epsilon after each round: the un-amplified and cyclic-Poisson curves
* ``posthoc``         per-user epsilon from the observed participation pattern
* ``releases``        the round's extra Gaussian releases (the count, the client-metric release), described once
* ``count_release``   those releases (σ_unit; adaptive clipping's noisy count alone: σ_b) composed with the MF
                      mechanism; ρ-zCDP
* ``cyclic_poisson``  amplified BandMF with cyclic Poisson sampling (dp_accounting)
* ``bminsep``         b-min-sep sampling: the sampled mechanism, its dominating-pair privacy loss
* ``montecarlo``      the Monte Carlo accountant of b-min-sep sampling (losses, chunks, workers)
* ``evr``             Estimate-Verify-Release calibration with an analytic fallback
* ``mmcc``            MMCC: amplified epsilon of a non-negative lower-triangular C under
                      Poisson sampling in every round (``--sampling poisson:P``)

The ``fedmf epsilon`` and ``fedmf calibrate`` commands live in ``fedmf.cli.accounting``.

Noise convention: noise std = z·ζ·sens, sens the sensitivity of C under the planned
participation schema (see ``accountant``). Adjacency: add-or-remove (zero-out).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Accounting", "MonteCarloOptions", "epsilon", "calibrate", "epsilon_by_round", "account_observed"]

_EXPORTS = {
    "Accounting": "accountant", "MonteCarloOptions": "accountant", "epsilon": "accountant",
    "calibrate": "accountant", "epsilon_by_round": "accountant", "account_observed": "posthoc",
}


def __getattr__(name: str) -> Any:  # lazy: importing the package stays cheap (CLI, MC workers)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
