"""The Flower adapter's own run-configuration keys, and the app's one defaults table.

The engine's keys and their defaults are ``fedmf.config.DEFAULTS`` (every backend reads them); the keys
only the Flower ServerApp reads are this table, ``FLOWER_DEFAULTS``. ``APP_DEFAULTS`` is the two merged,
the engine's first: the one defaults table, which ``pyproject.toml``'s ``[tool.flwr.app.config]`` equals
key for key, in order and with its types (tests/test_config.py). ``ServerConfig`` is what the
ServerApp validates once, before round 1: the engine's ``RunConfig`` and these keys.

    reply-timeout     600.0                       seconds to wait for a round's replies
    identity          "enrolled" | "declared-insecure"   deployment: users prove an enrolled key, or (insecure,
                                                  logged) the user-id a SuperNode declares is trusted
    user-enrollment   ""                          the enrollment file (``fedmf user enroll``); a deployment
                                                  with identity "enrolled" needs it
    identity-timeout  30.0                        seconds to wait for identity replies (then backoff per node)
    secure-aggregation "off" | "secaggplus"       "secaggplus": the server learns only the sum of the clipped,
                                                  quantized updates (and of the clipped client metric; SecAgg+,
                                                  server/secagg_round.py; README "Secure aggregation (preview)");
                                                  the plan records it (fingerprint, inflation)
    secagg-degree     0                           k, neighbours of each client in SecAgg+'s random graph (even);
                                                  0 with secagg-threshold 0: k and t derived from each round's
                                                  cohort for exposure ≤ 2^-40 at 5 % colluding clients,
                                                  honest-but-curious and deviating server alike
                                                  (fedmf.secagg.params.graph_for: k = 28, t = 22 above 29
                                                  clients, the complete graph below)
    secagg-threshold  0                           t, shares that reconstruct a secret (2t > k + 1; a cohort
                                                  below t aborts the round); set with secagg-degree or 0
    secagg-bits       32                          b, the sum is computed modulo 2^b (no wrap: checked)
    secagg-scale      65536.0                     s, fixed-point units per unit of the clipped update
    secagg-stage-timeout 120.0                    seconds to wait for one stage's replies (the collect stage,
                                                  where clients train, waits at least reply-timeout)

The SecAgg+ parameters' security meaning is ``fedmf.secagg.params.SecAggParams``'s docstring.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fedmf.config import DEFAULTS, RunConfig, read_float, read_int, read_text
from fedmf.errors import ConfigError
from fedmf.secagg.errors import SecAggError
from fedmf.secagg.params import DEFAULT_BITS, DEFAULT_DEGREE, DEFAULT_SCALE, DEFAULT_THRESHOLD, MIN_BITS, SecAggParams

__all__ = ["FLOWER_DEFAULTS", "APP_DEFAULTS", "ServerConfig"]

#: the defaults of the keys only the Flower adapter reads (pyproject.toml's app config ends with them)
FLOWER_DEFAULTS: dict[str, Any] = {
    "reply-timeout": 600.0, "identity": "enrolled", "user-enrollment": "", "identity-timeout": 30.0,
    "secure-aggregation": "off", "secagg-degree": DEFAULT_DEGREE, "secagg-threshold": DEFAULT_THRESHOLD,
    "secagg-bits": DEFAULT_BITS, "secagg-scale": DEFAULT_SCALE, "secagg-stage-timeout": 120.0,
}
#: the values of the secure-aggregation key
SECURE_AGGREGATION = ("off", "secaggplus")
#: the one defaults table: the engine's keys, then the adapter's (pyproject.toml's [tool.flwr.app.config])
APP_DEFAULTS: dict[str, Any] = {**DEFAULTS, **FLOWER_DEFAULTS}


@dataclass(frozen=True)
class ServerConfig(RunConfig):
    """A validated configuration of the Flower app: the engine's ``RunConfig`` and the adapter's keys."""

    reply_timeout: float = 600.0
    identity: str = "enrolled"
    user_enrollment: str | None = None
    identity_timeout: float = 30.0
    #: None: the central mode; else the SecAgg+ parameters of a secure-aggregation run
    secagg: SecAggParams | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base_dir: str | os.PathLike | None = None) -> ServerConfig:
        """Validate a mapping of kebab-case keys of ``APP_DEFAULTS`` (unknown keys are refused; missing
        ones default). Relative paths are taken from ``base_dir`` (default: the working directory)."""
        unknown = sorted(set(values) - set(APP_DEFAULTS))
        if unknown:
            raise ConfigError(f"unknown configuration key {unknown[0]!r} (known: {', '.join(sorted(APP_DEFAULTS))})")
        engine = RunConfig.from_mapping({k: v for k, v in values.items() if k in DEFAULTS}, base_dir=base_dir)
        v = {**FLOWER_DEFAULTS, **{k: x for k, x in values.items() if k in FLOWER_DEFAULTS}}
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        identity = read_text("identity", v["identity"])
        if identity not in ("enrolled", "declared-insecure"):
            raise ConfigError(f"identity must be enrolled or declared-insecure, got {identity!r}")
        enrollment = read_text("user-enrollment", v["user-enrollment"])
        if enrollment and identity != "enrolled":
            raise ConfigError("user-enrollment is set but identity is declared-insecure: choose one")
        return cls(**{f.name: getattr(engine, f.name) for f in fields(RunConfig)},
                   reply_timeout=read_float("reply-timeout", v["reply-timeout"], strict=True),
                   identity=identity, user_enrollment=str(base / enrollment) if enrollment else None,
                   identity_timeout=read_float("identity-timeout", v["identity-timeout"], strict=True),
                   secagg=_secagg(v))


def _secagg(v: Mapping[str, Any]) -> SecAggParams | None:
    """The SecAgg+ parameters when ``secure-aggregation`` is "secaggplus" (checked: ``SecAggParams``),
    else None; the parameters are read (and checked) either way."""
    mode = read_text("secure-aggregation", v["secure-aggregation"])
    if mode not in SECURE_AGGREGATION:
        raise ConfigError(f"secure-aggregation must be off or secaggplus, got {mode!r}")
    try:
        params = SecAggParams(degree=read_int("secagg-degree", v["secagg-degree"], 0),
                              threshold=read_int("secagg-threshold", v["secagg-threshold"], 0),
                              bits=read_int("secagg-bits", v["secagg-bits"], MIN_BITS),
                              scale=read_float("secagg-scale", v["secagg-scale"], strict=True),
                              stage_timeout_s=read_float("secagg-stage-timeout", v["secagg-stage-timeout"],
                                                         strict=True))
    except SecAggError as e:
        raise ConfigError(str(e)) from None
    return None if mode == "off" else params
