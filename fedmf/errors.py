"""The one family of errors a user can cause: bad input, a plan that does not fit, a budget
or horizon reached. Each carries a one-line message; the CLI catches ``FedmfError`` only, so
that a real bug stays a traceback.

``FedmfError`` subclasses ``ValueError`` so that code written against the engine's earlier
``ValueError``s keeps working; ``ConfigTypeError`` (a value of the wrong type) is also a
``TypeError``.

The rule: an error the user, a client or a file can cause is raised as a ``FedmfError``
subclass by the engine itself, where it is found (``fedmf.checks`` holds the shared checks),
so no caller translates ``ValueError`` into ``FedmfError``. Only a state that cannot happen
without a bug in fedmf (an optimizer leaving its feasible family, an interpreter missing for a
noise description) stays a ``RuntimeError``/``AssertionError``/``TypeError``: a traceback.
"""

from __future__ import annotations

__all__ = [
    "FedmfError", "ConfigError", "PlanMismatch", "PrivacyBudgetExceeded", "HorizonReached", "RoundOrderError",
    "CheckpointError", "ConfigTypeError", "OutcomeError", "CohortTooSmall", "NotLearning",
]


class FedmfError(ValueError):
    """Something the user (or a client, or a file) got wrong; the message is one line."""


class ConfigError(FedmfError):
    """A configuration value, CLI argument or plan parameter is invalid."""


class ConfigTypeError(ConfigError, TypeError):
    """A value of the wrong type (a string for a number, a bool for an integer, …)."""


class PlanMismatch(FedmfError):
    """A checkpoint, ledger or noise state belongs to another plan than the one configured."""


class PrivacyBudgetExceeded(FedmfError):
    """The next round would spend more than the target ε."""


class HorizonReached(FedmfError):
    """The mechanism covers no more rounds (noise is never repeated or reused)."""


class RoundOrderError(FedmfError):
    """A round was asked for out of order (the privatizer serves only the next round)."""


class CheckpointError(FedmfError):
    """A checkpoint that cannot be read, trusted or written."""


class OutcomeError(FedmfError):
    """A run directory's outcome file (``fedmf.run.outcome``) is missing or cannot be trusted."""


class CohortTooSmall(FedmfError):
    """Too few users are eligible to fill the next round (``fedmf.run.cohort``): it is not played, and
    nothing of it is recorded or released."""


class NotLearning(FedmfError):
    """The run stopped because its model is not finite or its held-out loss diverged
    (``fedmf.run.learning_check``); every committed round stays committed and accounted."""
