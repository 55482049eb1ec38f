"""Which Ray the Flower simulation runs on: a fresh local Ray (the default) or an existing cluster.

Flower 1.42's simulation engine (``flwr-simulation``, its Ray backend
``flwr/server/superlink/fleet/vce/backend/raybackend.py``) calls ``ray.init(**init_args)`` with no
``address``; the federation config (``flwr run --federation-config``, ``SimulationConfig``) can carry
only ``init-args-num-cpus``, ``init-args-num-gpus``, ``init-args-logging-level`` and
``init-args-log-to-driver`` — no address. What ``ray.init()`` does without an address is read the
environment variable ``RAY_ADDRESS``; ``flwr-simulation`` is started by the SuperLink's SuperExec,
which inherits the SuperLink's environment. So the address travels as ``RAY_ADDRESS`` in the
SuperLink's environment (:func:`ray_environment`).

Without an address, ``ray.init()`` would also join whatever cluster ``/tmp/ray/ray_current_cluster``
names (the last ``ray start`` on the machine) or an inherited ``RAY_ADDRESS``; ``RAY_ADDRESS=local``
makes it start a fresh local Ray instead, always.

On an existing cluster ``init-args-num-cpus``/``-num-gpus`` must stay unset (``ray.init`` refuses
them when it connects); each virtual client's resources are ``client-resources-num-cpus`` (a whole
number: Flower 1.42 stores it as an unsigned integer) and ``client-resources-num-gpus`` (a fraction
of a GPU), which size the actors the pool places across the cluster's nodes.
"""

from __future__ import annotations

import socket

from fedmf.errors import ConfigError

__all__ = ["RAY_ADDRESS_VAR", "ray_environment", "client_resources", "check_reachable"]

#: read by ``ray.init()`` when it is called without an address (ray/_private/worker.py)
RAY_ADDRESS_VAR = "RAY_ADDRESS"


def ray_environment(address: str | None) -> dict[str, str]:
    """The environment entries that make the simulation's ``ray.init()`` join the cluster at
    ``address`` (its GCS, ``HOST:PORT``), or start a fresh local Ray when ``address`` is None."""
    return {RAY_ADDRESS_VAR: address if address is not None else "local"}


def client_resources(num_cpus: int, num_gpus: float | None) -> dict[str, int | float]:
    """The federation-config entries for one virtual client's Ray resources (``num_gpus`` None:
    Flower's default, no GPU)."""
    out: dict[str, int | float] = {"client-resources-num-cpus": int(num_cpus)}
    if num_gpus is not None:
        out["client-resources-num-gpus"] = float(num_gpus)
    return out


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A one-line ConfigError unless something accepts TCP connections at ``address`` (``HOST:PORT``,
    checked by ``fedmf.checks.host_port``): a cluster that is not there fails here, not after the
    simulation engine's own connection retries."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") else host
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"no Ray cluster answers at {address} ({reason}): start one with "
                          f"`ray start --head --port {port}` on that host, or check the address") from None
