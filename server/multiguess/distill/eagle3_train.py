"""Training an EAGLE-3 head with "training-time test", and measuring it the way drafting uses it.

Sequence ``x``, target features ``g`` (``g_j`` computed at position j, where the target
predicts ``x_{j+1}``). Step 0 at draft position j reads ``(embed(x_{j+1}), fc(g_j))`` and
predicts ``x_{j+2}``. Step k reads ``(embed(x_{j+1+k}), h^{k-1}_j)``, the head's own output of
the step before, and predicts ``x_{j+2+k}``: what a node k levels below the root sees when
drafting, where no target feature exists yet. Step k's row j sits at rotary position ``j + k``
and attends to step 0's keys at positions up to j (the context the target computed) and to
its own chain's keys of steps 1..k at row j (its ancestors in the tree), exactly the keys a
drafted node sees. The loss at each step is the cross-entropy against the teacher's top-k
restricted to the draft vocabulary, weighted ``0.8 ** k``; positions whose teacher token lies
outside the draft vocabulary are left out (the head cannot propose it).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from multiguess.distill.evaluate import MAX_K
from multiguess.distill.teacher import Record
from multiguess.engine.eagle3_head import Eagle3Config, Eagle3Head, default_aux_layers

STEP_WEIGHT = 0.8


@dataclass
class HeadBatch:
    ids: torch.Tensor  # long [B, W], right-padded
    features: torch.Tensor  # [B, W, F] target features
    lengths: torch.Tensor  # long [B]
    teacher_ids: torch.Tensor  # long [B, W, k]: draft ids of the teacher's top-k at position t (-1: none)
    teacher_logprobs: torch.Tensor  # float [B, W, k]
    labelled: torch.Tensor  # bool [B, W]: position t is labelled (predicts a recorded x_{t+1})
    in_vocab: torch.Tensor  # bool [B, W]: ... and the teacher's top-1 is in the draft vocabulary


def collate_head(
    records: Sequence[Record], features: Sequence[torch.Tensor], t2d_index: torch.Tensor, pad_id: int
) -> HeadBatch:
    """Pad records and their features; place each teacher top-k at its position."""
    width = max(len(r.ids) for r in records)
    batch = len(records)
    k = records[0].topk_ids.shape[1]
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    feats = torch.zeros((batch, width, features[0].shape[-1]), dtype=features[0].dtype)
    teacher_ids = torch.full((batch, width, k), -1, dtype=torch.long)
    teacher_logprobs = torch.zeros((batch, width, k))
    labelled = torch.zeros((batch, width), dtype=torch.bool)
    for i, (r, f) in enumerate(zip(records, features, strict=True)):
        n = len(r.ids)
        ids[i, :n] = r.ids.long()
        feats[i, :n] = f
        positions = slice(r.start - 1, n - 1)
        teacher_ids[i, positions] = t2d_index[r.topk_ids.long()]
        teacher_logprobs[i, positions] = r.topk_logprobs.float()
        labelled[i, positions] = True
    lengths = torch.tensor([len(r.ids) for r in records])
    return HeadBatch(
        ids, feats, lengths, teacher_ids, teacher_logprobs, labelled, labelled & (teacher_ids[..., 0] >= 0)
    )


def chain_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """Row j of ``q`` ``[B, H, W, d]`` over ``keys[0]`` at positions <= j and ``keys[1:]`` at row j."""
    heads, width = q.shape[1], q.shape[2]
    rep = heads // keys[0].shape[1]
    k0, v0 = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)
    scores = (q @ k0.transpose(-1, -2)) * scale
    causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    own = [(q * km.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for km in keys[1:]]
    p = torch.softmax(torch.cat([scores, *own], dim=-1).float(), dim=-1).to(v0.dtype)
    out = p[..., :width] @ v0
    for m, vm in enumerate(values[1:]):
        out = out + p[..., width + m : width + m + 1] * vm.repeat_interleave(rep, 1)
    return out


def ttt_hidden(
    head: Eagle3Head, embed: torch.nn.Module, batch: HeadBatch, steps: int, pad_id: int
) -> list[torch.Tensor]:
    """The head's output features ``[B, W, hidden]`` at each of ``steps`` chained steps."""
    c = head.config
    ids = batch.ids
    bsz, width = ids.shape
    hidden = head.fuse(batch.features)
    scale = c.dim**-0.5
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs = []
    for k in range(steps):
        shifted = F.pad(ids[:, 1 + k :], (0, 1 + k), value=pad_id)
        embeds = embed(shifted).to(hidden.dtype)
        positions = (torch.arange(width) + k)[None].expand(bsz, width)
        q, kk, vv = head.qkv(embeds, hidden, head.rope(embeds, positions))
        keys.append(kk)
        values.append(vv)
        hidden = head.finish(chain_attention(q, keys, values, scale), hidden)
        outs.append(hidden)
    return outs


def ttt_loss(
    head: Eagle3Head, outs: list[torch.Tensor], batch: HeadBatch
) -> tuple[torch.Tensor, list[float]]:
    """Weighted loss over the steps, and each step's top-1 agreement with the teacher."""
    total = torch.zeros(())
    top1 = []
    for k, hidden in enumerate(outs):
        valid = batch.in_vocab[:, 1 + k :]
        rows = hidden[:, : valid.shape[1]][valid]
        if not len(rows):
            top1.append(0.0)
            continue
        logprobs = torch.log_softmax(head.logits(rows).float(), dim=-1)
        tid = batch.teacher_ids[:, 1 + k :][valid]
        present = tid >= 0
        weights = torch.softmax(
            batch.teacher_logprobs[:, 1 + k :][valid].masked_fill(~present, float("-inf")), -1
        )
        picked = logprobs.gather(-1, tid.clamp(min=0))
        loss = -(weights * picked).masked_fill(~present, 0.0).sum(-1).mean()
        total = total + STEP_WEIGHT**k * loss
        top1.append((logprobs.argmax(-1) == tid[:, 0]).float().mean().item())
    return total, top1


@torch.inference_mode()
def head_quality(
    head: Eagle3Head,
    embed: torch.nn.Module,
    records: Sequence[Record],
    features: Sequence[torch.Tensor],
    pad_id: int,
    depth: int = 4,
    batch_size: int = 8,
    autocast: bool = False,
) -> dict[str, float]:
    """Held-out greedy acceptance, top-k coverage and chain tokens per verify step (``depth``).

    Teacher-forced on the target's own greedy replies, as ``evaluate.quality`` measures a draft:
    at every reply position the head sees the true prefix; a chain's k-th token is the head's
    step-k guess there, fed the earlier guesses' features, which is what a chain drafts when the
    earlier guesses were right. ``depth_acceptance[k]``: the k-th chain token right, given the
    ones before it were."""
    vocab = head.draft_to_target.cpu()
    t2d_index = target_to_draft_index(vocab, head.config.vocab_size)
    hits = torch.zeros(MAX_K)
    total = 0
    reached, right = torch.zeros(depth), torch.zeros(depth)
    chains = []
    for start in range(0, len(records), batch_size):
        chunk = list(range(start, min(start + batch_size, len(records))))
        batch = collate_head([records[i] for i in chunk], [features[i] for i in chunk], t2d_index, pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = ttt_hidden(head, embed, batch, depth, pad_id)
            guesses = [vocab[head.logits(h).float().topk(MAX_K, dim=-1).indices] for h in outs]
        for row, i in enumerate(chunk):
            r = records[i]
            n = len(r.ids)
            ids = batch.ids[row]
            # Teacher position t predicts x[t + 1]: head row t - 1 at step k guesses x[t + 1 + k].
            first = max(1, r.start - 1)
            tops = guesses[0][row, first - 1 : n - 2]
            hits += (tops == ids[first + 1 : n, None]).cumsum(1).clamp(max=1).sum(0).float()
            total += len(tops)
            best = [guesses[k][row, :, 0].tolist() for k in range(depth)]
            tokens = ids.tolist()
            matches = [
                [best[k][t - 1] == tokens[t + 1 + k] for k in range(depth) if t + 1 + k < n]
                for t in range(first, n - 1)
            ]
            for m in matches:
                for k, ok in enumerate(m):
                    reached[k] += 1
                    right[k] += ok
                    if not ok:
                        break
            chains.append(chain_walk(matches))
    coverage = (hits / max(1, total)).tolist()
    return {
        "acceptance": coverage[0],
        **{f"top{k + 1}_coverage": coverage[k] for k in range(MAX_K)},
        f"chain{depth}_tokens_per_step": statistics.fmean(chains) if chains else 0.0,
        "depth_acceptance": (right / reached.clamp(min=1)).tolist(),
        "positions": total,
        "sequences": len(records),
    }


def chain_walk(matches: list[list[bool]]) -> float:
    """Tokens per verify step of chain drafting over one reply: from each position reached, the
    guesses right in a row, plus the target's own token."""
    position, steps, emitted = 0, 0, 0
    while position < len(matches):
        accepted = 0
        for ok in matches[position]:
            if not ok:
                break
            accepted += 1
        emitted += min(accepted + 1, len(matches) - position)
        position += accepted + 1
        steps += 1
    return emitted / max(1, steps)


def target_to_draft_index(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """For every target id, its draft id (column), or -1 when the head does not score it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return index


def target_rope(config: object) -> tuple[float, dict | None]:
    """The target's rotary base and scaling, from either transformers spelling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    scaling = (
        params if params.get("rope_type", "default") != "default" else getattr(config, "rope_scaling", None)
    )
    return theta, scaling


def build_head(target, vocab_ids: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A fresh head shaped like one of the target's layers, scoring ``vocab_ids``; its output
    layer and norm start from the target's own (its features live in the same space)."""
    tc = target.config
    theta, scaling = target_rope(tc)
    config = Eagle3Config(
        hidden_size=tc.hidden_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        intermediate_size=tc.intermediate_size,
        vocab_size=tc.vocab_size,
        draft_vocab_size=len(vocab_ids),
        target_hidden_size=tc.hidden_size,
        aux_layers=default_aux_layers(tc.num_hidden_layers),
        head_dim=getattr(tc, "head_dim", None),
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=tc.max_position_embeddings,
    )
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    head.set_vocabulary(vocab_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[vocab_ids.long()].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
    return head


def frozen_embedding(target) -> torch.nn.Embedding:
    """The target's token embeddings, which the head reads but does not train."""
    weight = target.model.embed_tokens.weight.detach().float()
    return torch.nn.Embedding.from_pretrained(weight, freeze=True)
