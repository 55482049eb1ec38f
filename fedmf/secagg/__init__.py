"""Secure aggregation with correlated noise: the engine's part (no Flower here).

The server should learn only the sum of the clipped updates, to which it adds the run's
correlated noise as in the central mode (ARCHITECTURE.md, rules 1–3). This package holds what
the sum needs beyond Flower's cryptography:

* ``params.py``: ``SecAggParams`` — SecAgg+ (Bell et al., CCS 2020) graph degree k, threshold t,
  modulus bits, fixed-point scale, rounding β, stage timeout; each with its security meaning,
  checked where built (2t > k + 1, even k, 4 ≤ bits ≤ 62).
* ``quantize.py``: fixed-point encoding modulo 2^b with conditional randomized rounding
  (Kairouz, Liu, Steinke, ICML 2021, Thm. 1), so that every encoded update's norm is within a
  stated bound checked in exact integers; the inflation factor; the unclipped bit as one extra
  coordinate; centred decoding of the modular sum to float64; ``check_no_wrap`` /
  ``max_safe_cohort`` refusing a cohort whose sum could wrap.
* ``sensitivity.py``: ζ_eff = ζ · inflation, the clip norm the sensitivity takes in this mode.
* ``masks.py``: masks expanded from 32-byte secrets (HKDF + ChaCha20 from ``cryptography``),
  arithmetic modulo 2^b.
* ``messages.py``: what both ends agree on beyond Flower's record keys (extra keys, share
  order, the commitment to a mask seed, the wire form of a payload in a ConfigRecord).
* ``encode.py``: what a client does before masking (checks, ℓ∞ zeroing, clip to ζₜ, ÷ ζₜ and the
  bit under adaptive clipping, quantize) and the run's one ``Quantization`` (``quantization_for``).
* ``secure_sum.py``: ``SecureSum``, the decoded sum, the decoded count, the contributors, the
  refused users and the inflation, which ``PrivateRun.aggregate`` privatizes with
  ``RoundPrivatizer.privatize_sum`` (``fedmf/round/privatize.py``: the central path's noise and
  scaling, σ from ζ_eff, ÷ the planned m; the count release reads the decoded count).
* ``errors.py``: ``SecAggError`` and ``SecAggAbort`` (``FedmfError`` family).

The protocol itself lives in the adapters: ``server/secagg.py`` (the server's four stages as a
pure state machine over plain dict payloads, dropouts recovered from ≥ t shares, abort below
the threshold, hostile replies rejected) and ``client/secagg.py`` (the client's answers and its
checks against a lying server), both on Flower's primitives (key agreement, Fernet, Shamir).
Wired into a round of the Flower app (run-config ``secure-aggregation = "secaggplus"``):
``server/secagg_round.py`` runs the stages over the Grid, one TRAIN message per stage per node,
for ``server/strategy.py`` (a ``SecAggAbort`` aborts the round, which is redone with fresh noise);
``client/secagg_app.py`` answers them, the client's protocol state kept in its ``Context.state``.
Tests: ``tests/secagg/`` (the engine path against the central path: equal up to the bounded
quantization error, bit-equal on the grid) and ``tests/flower/test_secure_aggregation.py``.

Not built yet (issue 36): ``fedmf simulate --secure-aggregation`` (the in-process backend and the
Flower backend's CLI); the plan's fingerprint and the audit recording that a run used secure
aggregation and its inflation (the ledger's per-round noise std already includes it); the
client-metric release inside the masked vector (refused with secure aggregation for now); a
real-process run on loopback with TLS and node authentication; deploy/README; Bell et al.'s
consistency round against a server lying about dropouts (today limited only by 2t > k + 1). The
cost per round is measured by ``benchmarks/secagg_cost.py`` (BENCHMARKS.md, "Secure aggregation:
cost per round").
"""
