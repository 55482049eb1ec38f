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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fedmf.config import DEFAULTS, RunConfig, read_float, read_text
from fedmf.errors import ConfigError

__all__ = ["FLOWER_DEFAULTS", "APP_DEFAULTS", "ServerConfig"]

#: the defaults of the keys only the Flower adapter reads (pyproject.toml's app config ends with them)
FLOWER_DEFAULTS: dict[str, Any] = {
    "reply-timeout": 600.0, "identity": "enrolled", "user-enrollment": "", "identity-timeout": 30.0,
}
#: the one defaults table: the engine's keys, then the adapter's (pyproject.toml's [tool.flwr.app.config])
APP_DEFAULTS: dict[str, Any] = {**DEFAULTS, **FLOWER_DEFAULTS}


@dataclass(frozen=True)
class ServerConfig(RunConfig):
    """A validated configuration of the Flower app: the engine's ``RunConfig`` and the adapter's keys."""

    reply_timeout: float = 600.0
    identity: str = "enrolled"
    user_enrollment: str | None = None
    identity_timeout: float = 30.0

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
                   identity_timeout=read_float("identity-timeout", v["identity-timeout"], strict=True))
