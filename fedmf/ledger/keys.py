"""Pseudonymous client keys: HMAC-SHA256 under a server secret.

A client identifier never reaches the ledger, a log line or an error message in clear:
the ledger stores ``HMAC-SHA256(secret, "fedmf-ledger/v1/client" ‖ run ‖ id)`` (32 bytes),
so the same client has unlinkable keys in two runs, and nobody without the secret can
test a guess. Lifetime budgets link a user's runs on purpose, under a separate ledger-wide budget
secret: ``HMAC-SHA256(budget secret, "fedmf-ledger/v1/lifetime" ‖ id)``. The secret itself is never stored; a run keeps only a *key check*
(an HMAC of a fixed label under the secret), which tells a resumed server that it was
given the same secret without revealing anything about it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from .. import checks
from ..errors import ConfigError, ConfigTypeError

__all__ = ["ServerSecret", "MIN_SECRET_BYTES"]

MIN_SECRET_BYTES = 16
_CLIENT_LABEL = b"fedmf-ledger/v1/client\x00"
_CHECK_LABEL = b"fedmf-ledger/v1/key-check"
_LIFETIME_LABEL = b"fedmf-ledger/v1/lifetime\x00"


class ServerSecret:
    """Holds the server secret; its repr and str never show it."""

    __slots__ = ("_mac",)

    def __init__(self, secret: bytes | bytearray | str) -> None:
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        if not isinstance(secret, (bytes, bytearray)):
            raise ConfigTypeError("the server secret must be bytes")
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"the server secret must be at least {MIN_SECRET_BYTES} bytes long")
        self._mac = hmac.new(bytes(secret), digestmod=hashlib.sha256)

    def __repr__(self) -> str:
        return "ServerSecret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):  # never pickled (checkpoints, multiprocessing)
        checks.refuse_pickle(self)

    def key_check(self) -> str:
        """Hex HMAC of a fixed label: identifies the secret without revealing it."""
        mac = self._mac.copy()
        mac.update(_CHECK_LABEL)
        return mac.hexdigest()

    def client_key(self, run_uid: str, client: object) -> bytes:
        """The 32-byte pseudonymous key of ``client`` (any str/int/bytes identifier) in one run."""
        mac = self._mac.copy()
        mac.update(_CLIENT_LABEL + run_uid.encode("ascii") + b"\x00" + _id_bytes(client))
        return mac.digest()

    def lifetime_key(self, client: object) -> bytes:
        """The 32-byte pseudonymous key of ``client`` that is the same in every run: under the
        ledger-wide budget secret (never a run's own secret) it links one user's runs for their
        lifetime budget (``fedmf.ledger.budgets``), and only that."""
        mac = self._mac.copy()
        mac.update(_LIFETIME_LABEL + _id_bytes(client))
        return mac.digest()

    def client_keys(self, run_uid: str, clients: Iterable[object]) -> list[bytes]:
        prefix = self._mac.copy()
        prefix.update(_CLIENT_LABEL + run_uid.encode("ascii") + b"\x00")
        out = []
        for client in clients:
            mac = prefix.copy()
            mac.update(_id_bytes(client))
            out.append(mac.digest())
        return out


def _id_bytes(client: object) -> bytes:
    if isinstance(client, bytes):
        return b"b" + client
    if isinstance(client, bool) or not isinstance(client, (str, int)):
        raise ConfigTypeError(f"a client identifier must be str, int or bytes, not {type(client).__name__}")
    return b"s" + str(client).encode("utf-8")  # 7 and "7" are the same client (Flower node ids)
