"""Next-word prediction models for the text tasks (stackoverflow, so-synthetic, shakespeare).

The family of "Adaptive Federated Optimization" / DP-FTRL / "Multi-Epoch Matrix Factorization":
embedding → one LSTM layer → dense (hidden → embedding size, linear) → output (→ all ids), untied.

* ``"paper"``: embedding 96, LSTM 670, dense 670→96, output 96→10,004 (vocab 10,000):
  4,053,428 parameters in PyTorch (which keeps two LSTM bias vectors where Keras has one).
* ``"small"``: embedding 32, LSTM 64, dense 64→32, output 32→vocab+4 (for 2-core runs).

Initialization follows Keras' defaults as TFF's model had them (uniform ±0.05 embedding,
Glorot-uniform kernels, orthogonal recurrent kernel, zero biases except the LSTM forget gate's
1), drawn from a ``torch.Generator`` seeded by the caller: the global RNG is never touched, and
the model is identical in every process.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import checks
from ..threads import one_thread

__all__ = ["WordLSTM", "make_word_model", "empty_word_model", "MODEL_SIZES", "PAPER_PARAMS"]

#: model_size -> (embedding, LSTM hidden)
MODEL_SIZES: dict[str, tuple[int, int]] = {"paper": (96, 670), "small": (32, 64)}
#: parameters of the "paper" model at vocab_size 10,000 (10,004 ids)
PAPER_PARAMS = 4_053_428


class WordLSTM(nn.Module):
    """ids (batch, time) int64 → logits (batch, time, num_ids)."""

    def __init__(self, num_ids: int, embed: int, hidden: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_ids, embed, device=device)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True, device=device)
        self.dense = nn.Linear(hidden, embed, device=device)
        self.output = nn.Linear(embed, num_ids, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """ids (batch, time) → the LSTM's outputs (batch, time, hidden); causal: position t depends
        on x[:, :t + 1] only."""
        h, _ = self.lstm(self.embedding(x))
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """LSTM outputs (..., hidden) → logits (..., num_ids), position by position."""
        return self.output(self.dense(h))


def empty_word_model(model_size: str, vocab_size: int) -> WordLSTM:
    """A model of ``model_size`` over ``vocab_size`` words (+ pad, OOV, BOS, EOS), its tensors
    allocated but not initialized (no RNG draw): load a state into it."""
    embed, hidden = MODEL_SIZES[checks.one_of("model_size", model_size, sorted(MODEL_SIZES))]
    model = WordLSTM(vocab_size + 4, embed, hidden, device="meta").to_empty(device="cpu")
    model.lstm.flatten_parameters()
    return model


def make_word_model(model_size: str, vocab_size: int, seed: int) -> WordLSTM:
    """A freshly initialized model of ``model_size`` over ``vocab_size`` words (+ pad, OOV, BOS, EOS)."""
    model = empty_word_model(model_size, vocab_size)
    hidden = MODEL_SIZES[model_size][1]
    g = torch.Generator().manual_seed(seed)
    init = nn.init
    with torch.no_grad(), one_thread():  # one thread: a multi-threaded QR is slower here, and varies
        model.embedding.weight.uniform_(-0.05, 0.05, generator=g)
        # Keras kernels are (in, 4·hidden); PyTorch stores (4·hidden, in): same fan-in/fan-out bound.
        init.xavier_uniform_(model.lstm.weight_ih_l0, generator=g)
        init.orthogonal_(model.lstm.weight_hh_l0, generator=g)
        model.lstm.bias_ih_l0.zero_()
        model.lstm.bias_hh_l0.zero_()
        model.lstm.bias_ih_l0[hidden:2 * hidden] = 1.0  # gates i, f, g, o: unit forget bias
        for layer in (model.dense, model.output):
            init.xavier_uniform_(layer.weight, generator=g)
            layer.bias.zero_()
    model.lstm.flatten_parameters()
    return model
