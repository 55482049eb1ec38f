"""A ServerApp stopped by a fedmf error ends with one line, not Flower's traceback: Flower logs the
exception that ends a ServerApp (``flwr.superlink.runtime.run_serverapp``, ``flwr.simulation.app``)
through its logger with ``exc_info``; server.app's filter keeps that record to one line for a
``ServerAppError`` and leaves every other exception's traceback alone."""

from __future__ import annotations

import io
import logging

from flwr.common.logger import log

import server.app as server_app


def _flower_output(error: BaseException) -> str:
    """What Flower's "ServerApp raised an exception" record prints through a plain handler."""
    flower = logging.getLogger("flwr")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    flower.addHandler(handler)
    try:
        try:
            raise error
        except BaseException as e:  # noqa: BLE001 - as Flower catches it
            log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=e)
    finally:
        flower.removeHandler(handler)
    return stream.getvalue()


def test_a_serverapp_error_is_one_line_and_other_exceptions_keep_their_traceback():
    server_app._quiet_flower_tracebacks()
    server_app._quiet_flower_tracebacks()  # once per process, however often main runs
    filters = [f for f in logging.getLogger("flwr").filters if isinstance(f, server_app._NoTracebackForServerAppError)]
    assert len(filters) == 1
    out = _flower_output(server_app.ServerAppError("fedmf: error: run-dir: was written for another plan"))
    assert out == "ERROR ServerApp stopped: fedmf: error: run-dir: was written for another plan\n", out
    other = _flower_output(ValueError("a bug"))
    assert other.startswith("ERROR ServerApp raised an exception\nTraceback") and "ValueError: a bug" in other
