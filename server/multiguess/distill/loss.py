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


def sampled_topk_soft_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    negatives: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loss with the softmax over a candidate set instead of the whole vocabulary.

    Candidates are every id in the batch's teacher top-k plus ``negatives`` uniform draws; the
    drawn ones get ``log((V - |top-k ids|) / negatives)`` added to their logits, the usual
    sampled-softmax correction, so the normaliser still estimates the full one. The output
    layer is the cost of a small draft, and this cuts it several-fold. Returns (loss, whether the
    draft's best candidate is the teacher's top-1, per row).
    """
    vocab = weight.shape[0]
    teacher_ids = torch.unique(ids.long())
    drawn = torch.randint(0, vocab, (negatives,), generator=generator)
    drawn = drawn[~torch.isin(drawn, teacher_ids)].unique()
    candidates = torch.cat([teacher_ids, drawn])
    offset = torch.zeros(len(candidates))
    offset[len(teacher_ids) :] = torch.log(torch.tensor((vocab - len(teacher_ids)) / max(1, negatives)))
    logits = torch.nn.functional.linear(hidden, weight[candidates]).float() + offset
    local = torch.searchsorted(teacher_ids, ids.long())
    loss = topk_soft_cross_entropy(logits, local, logprobs)
    return loss, logits.detach().argmax(dim=-1) == local[:, 0]
