"""``tiny``: a fast generated federated classification task, for tests, examples and smoke runs.

Users "0" … "num_users-1" (the ids a Flower simulation's ``partition-id`` gives). Each user draws
from its own generator (seeded from ``seed`` and its id): a heavy-tailed example count (P(n > k) =
lo/k, capped at hi), its own class mix (softmax of 2·N(0, I) over 4 classes) and a small feature
shift; inputs are 8-dim Gaussian around the class means. ``evaluate`` uses ``eval_users`` further
users drawn the same way, who are not in the population. The model is an 8-16-4 MLP (212 float32
parameters).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import checks
from ..errors import ConfigError
from .base import check_options, stable_seed
from .supervised import SupervisedTask

__all__ = ["TinyTask"]

FEATURES, HIDDEN, CLASSES = 8, 16, 4
_DEFAULTS: dict[str, Any] = {"num_users": 20, "seed": 0, "examples_per_user": [8, 64], "eval_users": 10}


class TinyTask(SupervisedTask):
    """Generated non-IID 4-class data and a 2-layer MLP; see the module docstring."""

    name = "tiny"

    @classmethod
    def _validate(cls, options: dict[str, Any]) -> dict[str, Any]:
        out = check_options("tiny", options, _DEFAULTS)
        out["num_users"] = checks.integer("tiny num_users", out["num_users"], minimum=1, maximum=1_000_000)
        out["seed"] = checks.integer("tiny seed", out["seed"], minimum=0, maximum=2**63 - 1)
        out["eval_users"] = checks.integer("tiny eval_users", out["eval_users"], minimum=1, maximum=100_000)
        epu = out["examples_per_user"]
        if isinstance(epu, int) and not isinstance(epu, bool):
            epu = [epu, epu]
        if not isinstance(epu, (list, tuple)) or len(epu) != 2:
            raise ConfigError(f"tiny examples_per_user must be an integer or [min, max], got {out['examples_per_user']!r}")
        lo = checks.integer("tiny examples_per_user min", epu[0], minimum=1, maximum=100_000)
        hi = checks.integer("tiny examples_per_user max", epu[1], minimum=lo, maximum=100_000)
        out["examples_per_user"] = [lo, hi]
        return out

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        g = torch.Generator().manual_seed(stable_seed(self.options["seed"], "tiny-means"))
        self._means = 1.0 * torch.randn(CLASSES, FEATURES, generator=g)
        self._data: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._heldout: tuple[torch.Tensor, torch.Tensor] | None = None

    def users(self) -> list[str]:
        return [str(i) for i in range(self.options["num_users"])]

    def model(self) -> torch.nn.Module:
        skip = torch.nn.utils.skip_init  # no global-RNG draw at construction
        model = torch.nn.Sequential(skip(torch.nn.Linear, FEATURES, HIDDEN), torch.nn.ReLU(),
                                    skip(torch.nn.Linear, HIDDEN, CLASSES))
        g = torch.Generator().manual_seed(stable_seed(self.options["seed"], "tiny-model"))
        with torch.no_grad():
            for layer in (model[0], model[2]):
                bound = layer.in_features ** -0.5
                layer.weight.uniform_(-bound, bound, generator=g)
                layer.bias.uniform_(-bound, bound, generator=g)
        return model

    def _draw(self, kind: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(stable_seed(self.options["seed"], "tiny-user", kind, index))
        lo, hi = self.options["examples_per_user"]
        u = 1.0 - float(torch.rand((), generator=g))  # (0, 1]
        n = min(hi, int(lo / u))
        mix = torch.softmax(2.0 * torch.randn(CLASSES, generator=g), dim=0)
        shift = 0.3 * torch.randn(FEATURES, generator=g)
        y = torch.multinomial(mix, n, replacement=True, generator=g)
        x = self._means[y] + shift + torch.randn(n, FEATURES, generator=g)
        return x, y

    def user_data(self, user: str) -> tuple[torch.Tensor, torch.Tensor]:
        if user not in self._data:
            if not isinstance(user, str) or not user.isdigit() or str(int(user)) != user \
                    or int(user) >= self.options["num_users"]:
                raise ConfigError(f"unknown tiny user {user!r} (users are '0'..'{self.options['num_users'] - 1}')")
            self._data[user] = self._draw("train", int(user))
        return self._data[user]

    def heldout_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._heldout is None:
            parts = [self._draw("heldout", i) for i in range(self.options["eval_users"])]
            self._heldout = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        return self._heldout
