"""Who takes part in each round: the participation scheduler.

The privacy guarantee of an amplified run is a statement about the *sampler*, so each
scheme below is exactly the sampler its accountant assumes (``fedmf.accounting``):

* ``MinSepSelection`` (sampling ``none``, schema ``MinSep(b, k)``): each round a uniform
  subset of ``users_per_round`` available users among those with fewer than k selections
  whose last selection is >= b rounds back.
* ``BMinSepPoisson`` (``bminsep:P[:warm]``; Dong & Ganesh, "Privacy Amplification for
  BandMF via b-Min-Sep Subsampling", Alg. 1 cold / Alg. 2 warm start).
* ``CyclicPoisson`` (``cyclic-poisson:Q``; Choquette-Choo et al., "Scaling up BandMF", Alg. 2).
* ``FixedEpochOrder`` (sampling ``none``, schema ``FixedEpoch(k, b)``; "Multi-Epoch Matrix
  Factorization Mechanisms", Sec. 2: user slot j takes part in rounds j, j+b, ...).
* ``PoissonSampling`` (``poisson:P``; MMCC, Choquette-Choo et al. 2023: Poisson in every round).

One module per scheme (``min_sep``, ``bminsep``, ``cyclic_poisson``, ``poisson``, ``fixed_epoch``;
the amplified ones share ``population``), the interface in ``base``, the keyed stream in
``stream``, the state format in ``state``; ``make_scheduler`` (``factory``) builds the scheduler of
the plan's sampling scheme, a description (``fedmf.sampling``) it dispatches on by type.

Selections, not contributions, drive every rule: a selected user that drops out still used
its participation and still blocks for b-1 rounds (b-min-sep notes §7.1 item 2: actual
participations are then <= modelled ones elementwise). The schedule therefore never depends
on what clients send. Amplified schemes sample the whole population (every user ever
registered or seen in ``available``), whether or not a user is reachable now; a sampled
user who is not available is ``unreachable``: a dropout, i.e. a zero contribution.

Secret-seeded deterministic stream. Every random decision is a keyed BLAKE2b hash (the
caller's secret key of 16..64 bytes, made with ``secrets.token_bytes(32)`` and kept in a
0600 file; ``person=b"fedmf-sched-v1"``; 8-byte digest) of the message
``purpose + b"\\0" + round as 8-byte big-endian signed + str(user) as UTF-8``, read as a
big-endian unsigned 64-bit integer w. Purposes: ``pick`` (MinSep ranking), ``coin``
(Bernoulli coins), ``join`` (a b-min-sep user's chain state when it joins), ``group``
(cyclic group, round 0), ``slot`` (fixed-epoch shuffle, round 0). A coin of probability p
shows heads iff (w >> 11)·2⁻⁵³ < p (probability ⌈p·2⁵³⌉/2⁵³). Keyed BLAKE2b is a PRF, so
to anyone without the key the decisions are independent uniform draws, as the accountants
assume, and who was sampled stays secret. The same key, state and available *set* (in any
order) give the same ``Selection``, so a resumed run or a Flower run matches an in-process
run bit for bit. The key never appears in ``state_dict``, ``describe``, ``repr`` or errors;
the state carries only a keyed check value (a MAC of a constant) to refuse another key.

User identity is ``str(user)``. In a ``Selection``, reachable users are the caller's own
objects from ``available``; unreachable ones are their ids (``str``).
"""

from .base import Scheduler, Selection
from .bminsep import BMinSepPoisson
from .cyclic_poisson import CyclicPoisson
from .factory import make_scheduler
from .fixed_epoch import FixedEpochOrder
from .min_sep import MinSepSelection
from .poisson import PoissonSampling
from .state import STATE_FORMAT

__all__ = [
    "Selection", "Scheduler", "MinSepSelection", "BMinSepPoisson", "CyclicPoisson", "FixedEpochOrder",
    "PoissonSampling", "make_scheduler", "STATE_FORMAT",
]
