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
  order, the commitment to a mask seed).
* ``errors.py``: ``SecAggError`` and ``SecAggAbort`` (``FedmfError`` family).

The protocol itself lives in the adapters: ``server/secagg.py`` (the server's four stages as a
pure state machine over plain dict payloads, dropouts recovered from ≥ t shares, abort below
the threshold, hostile replies rejected) and ``client/secagg.py`` (the client's answers and its
checks against a lying server), both on Flower's primitives (key agreement, Fernet, Shamir).
Tests: ``tests/secagg/``.

Not built yet (issue 36): wiring into the round (``fedmf/round/``: the plan's σ from ζ_eff, the
count release reading the decoded bit, a round aborted by ``SecAggAbort`` redone with fresh
noise and nothing released, the ledger's contributed/dropped users from ``contributors``);
the ``secure-aggregation`` run-config key and ``fedmf simulate --secure-aggregation``; the
ServerApp driving the stages over the Grid/Message API (with ``stage_timeout_s``) and the
ClientApp handlers (clip, ℓ∞ zeroing and shape checks on the client, quantize, mask);
the audit saying a run used secure aggregation; a real-process run on loopback with TLS and
node authentication; the comparison with the central mode in repeatable-noise mode; the cost
benchmarks (BENCHMARKS.md) and the README/deploy documentation with the threat model (an
honest-but-curious server for the updates, an honest server for the noise; a malicious client
can add any vector within the modulus; a server lying about dropouts is limited only by
2t > k + 1 — no consistency round of Bell et al.'s malicious variant yet).
"""
