"""Cross-entropy of the draft against the target's top-k distribution, with a cheap backward.

Over a 49k vocabulary the generic ``log_softmax`` backward costs more than the output layer's
matmuls on CPU; the gradient of this loss is simply ``softmax(logits) - p`` (p scattered onto
its top-k ids), computed here in one pass.
"""

from __future__ import annotations

import torch


class _TopKSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1)
        loss = (lse - (probs * logits.gather(1, ids)).sum(dim=1)).mean()
        ctx.save_for_backward(logits, lse, ids, probs)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, lse, ids, probs = ctx.saved_tensors
        grad = (logits - lse[:, None]).exp_()
        grad.scatter_add_(1, ids, -probs)
        grad.mul_(grad_output / len(grad))
        return grad, None, None


def topk_soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``-sum_i p_i log q(ids_i)``, p = the teacher's top-k renormalised.

    ``logits`` [N, V] are the draft's; ``ids`` [N, k] and ``logprobs`` [N, k] the teacher's top-k.
    Minimising it is minimising KL(p || q) restricted to the teacher's head.
    """
    probs = torch.softmax(logprobs.float(), dim=-1)
    return _TopKSoftCrossEntropy.apply(logits, ids.long(), probs)
