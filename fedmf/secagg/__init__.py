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
  coordinate, the private client metric's word ⌊clip(v, 0, L)·s⌋ as one more; the noisy release
  ``noisy_centred``, centre((W + s·N) mod 2^b)/s, the noise added to the modular sum before it is
  centred (exact for b ≤ 62; REVIEW-i36-privacy-path HIGH-1); ``check_no_wrap`` / ``max_safe_cohort``
  refusing a cohort whose sum plus a 12σ noise margin could wrap.
* ``sensitivity.py``: ζ_eff = ζ · inflation, the clip norm the sensitivity takes in this mode.
* ``masks.py``: masks expanded from 32-byte secrets (HKDF + ChaCha20 from ``cryptography``),
  arithmetic modulo 2^b.
* ``messages.py``: what both ends agree on beyond Flower's record keys (the consistency check's
  stage, extra keys, share order, the commitment to a mask seed, the wire form of a payload in a
  ConfigRecord).
* ``signing.py``: the byte strings clients sign (their advertised keys, the survivor set U3;
  domain-separated, length-prefixed Ed25519 statements) and the key helpers to check them.
* ``encode.py``: what a client does before masking (checks, ℓ∞ zeroing, clip to ζₜ as the central
  path clips, ÷ ζₜ after clipping and the bit under adaptive clipping, quantize) and the run's one
  ``Quantization`` (``quantization_for``).
* ``secure_sum.py``: ``SecureSum``, the unmasked modular sum's residues (not decoded), their
  ``Quantization``, the contributors and the refused users, which ``PrivateRun.aggregate`` privatizes
  with ``RoundPrivatizer.privatize_sum`` (``fedmf/round/privatize.py``: the central path's noise, σ
  from ζ_eff, added to the residues before centring, then its scaling, ÷ the planned m; the count and
  the metric likewise from their words' residues).
* ``errors.py``: ``SecAggError`` and ``SecAggAbort`` (``FedmfError`` family).

The protocol itself lives in the adapters: ``server/secagg.py`` (the server's five stages as a
pure state machine over plain dict payloads, dropouts recovered from ≥ t shares, abort below
the threshold, hostile replies rejected) and ``client/secagg.py`` (the client's answers and its
checks against a lying server, which hold against a deviating server where the node holds the
enrollment: docs/secagg-consistency.md), both on Flower's primitives (key agreement, Fernet, Shamir).
Wired into a round of the Flower app (run-config ``secure-aggregation = "secaggplus"``):
``server/secagg_round.py`` runs the stages over the Grid, one TRAIN message per stage per node,
for ``server/strategy.py`` (a ``SecAggAbort`` aborts the round, which is redone with fresh noise);
``client/secagg_app.py`` answers them, the client's protocol state kept in its ``Context.state``.
Tests: ``tests/secagg/`` (the engine path against the central path: equal up to the bounded
quantization error, bit-equal on the grid) and ``tests/flower/test_secure_aggregation.py``.

In simulation (``fedmf simulate --secure-aggregation``) the in-process rounds are
``server/secagg_inprocess.py``, found through the ``fedmf.secure_aggregation`` entry point; the
plan records the protocol, its parameters and the inflation (``RunPlan.with_secure_aggregation``:
the fingerprint, σ from ζ_eff), ``fedmf audit`` prints them; the private client metric travels as
the last masked word (``quantize.metric_word``).

Bell et al.'s consistency round (a survivor set U3 signed by the clients before any share is
revealed; ``signing.py``) guards against a server lying about dropouts; with enrolled users the
SecAgg+ keys are signed with their enrolled keys (docs/secagg-consistency.md).

The cost per round is measured by ``benchmarks/secagg_cost.py`` (BENCHMARKS.md, "Secure
aggregation: cost per round").
"""
