"""The StackOverflow next-word LSTM used by the server benchmarks (round.py, server.py)."""

from __future__ import annotations

import torch
from torch import nn

STACKOVERFLOW_PARAMS = 4_053_428


class StackOverflowLSTM(nn.Module):
    """The StackOverflow model of "Adaptive Federated Optimization" / "Multi-Epoch Matrix
    Factorization Mechanisms": embedding 96, one LSTM layer of 670, dense 96, output over 10,004 ids."""

    def __init__(self, vocab: int = 10004, embed: int = 96, hidden: int = 670) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.dense = nn.Linear(hidden, embed)
        self.output = nn.Linear(embed, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never trained here
        h, _ = self.lstm(self.embedding(x))
        return self.output(self.dense(h))


def make_model(quick: bool) -> nn.Module:
    """The full model (its parameter count and shapes asserted), or a small one for ``--quick``."""
    torch.manual_seed(0)
    model = StackOverflowLSTM(104, 16, 40) if quick else StackOverflowLSTM()
    size = sum(p.numel() for p in model.parameters())
    if not quick:
        assert size == STACKOVERFLOW_PARAMS, f"StackOverflow LSTM has {size} parameters, expected {STACKOVERFLOW_PARAMS}"
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        assert shapes == {
            "embedding.weight": (10004, 96), "lstm.weight_ih_l0": (2680, 96), "lstm.weight_hh_l0": (2680, 670),
            "lstm.bias_ih_l0": (2680,), "lstm.bias_hh_l0": (2680,), "dense.weight": (96, 670), "dense.bias": (96,),
            "output.weight": (10004, 96), "output.bias": (10004,)}, shapes
    return model
