"""Softmax cross-entropy with its gradient formed in the forward pass.

``F.cross_entropy`` runs ``log_softmax`` forward, then ``log_softmax``'s backward and
``nll_loss``'s (a zero-filled gradient the size of the logits) in the backward pass. Here the
forward pass computes the loss and the gradient together, from one ``exp`` of the logits:

    loss = mean_i [ logsumexp(z_i) − z_i[y_i] ]
    ∂loss/∂z_i = (softmax(z_i) − e_{y_i}) / N        (the standard softmax-regression gradient;
                                                     e.g. Bishop, PRML, Eq. 4.109)

with the max subtracted before ``exp`` (the usual stable logsumexp). Same value as
``F.cross_entropy(z, y)`` (mean) to float rounding; every row of ``z`` counts (select the rows
first: pad targets are dropped by the caller, not ignored here). First derivatives only.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["softmax_cross_entropy"]


class _SoftmaxCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        top = logits.amax(dim=1, keepdim=True)
        grad = torch.exp(logits - top)
        total = grad.sum(dim=1, keepdim=True)
        picked = logits.gather(1, targets[:, None])
        loss = (torch.log(total) + top - picked).mean()
        grad.div_(total)  # softmax(z_i)
        grad[torch.arange(len(targets), device=targets.device), targets] -= 1
        grad.mul_(1.0 / len(targets))
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        if torch.is_grad_enabled():  # create_graph=True: the saved gradient is a constant, its derivative wrong
            raise RuntimeError("softmax_cross_entropy is first-order only (no create_graph, no double backward)")
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None


def softmax_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (N, C) against int64 class ids ``targets`` (N,), N ≥ 1
    (not for torch.func transforms)."""
    if logits.ndim != 2 or targets.shape != logits.shape[:1] or len(targets) == 0:
        raise ValueError(f"softmax_cross_entropy needs logits (N, C) and targets (N,) with N >= 1, got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    return _SoftmaxCrossEntropy.apply(logits, targets)
