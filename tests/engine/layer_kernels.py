"""Checks the bf16 and the quantized layer kernels share: a runner's whole-layer kernel call
against the same kernels called one by one from Python, and trees of different sizes verified
a node per row against the same trees padded."""

from __future__ import annotations

import torch
from multiguess.engine.backends.cpu import bf16_kernel
from multiguess.engine.placement import Placement
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree, pack_trees


def assert_layer_kernel_is_per_op(
    fused: NativeRunner, per_op: NativeRunner, prompts: list[list[int]]
) -> None:
    """``per_op`` runs its layers one kernel at a time (products, rotary with the cache write,
    attention); after the two ``prompts`` are cached in both, a batch of two trees must give
    ``fused``'s logits bit for bit."""

    def layers(_: NativeRunner, x: torch.Tensor, at: Placement, *kernel: object) -> torch.Tensor:
        r = per_op
        rope = tuple(table[:, :, 0].contiguous() for table in at.rope)
        mask = at.mask[:, 0].contiguous()
        where = (torch.tensor(at.slots), at.write_from.to(torch.int64).contiguous())
        for i, layer in enumerate(r.layers):
            qkv = r.qkv[i](x, norm=layer.input_layernorm).view(*x.shape[:2], -1, r.head_dim).contiguous()
            q = bf16_kernel.rope_into_cache(qkv, *rope, r.cache.kv[i], *where, r.num_heads)
            out = bf16_kernel.attention(q, r.cache.kv[i], where[0], mask, r.attention_scale(i), at.length)
            h = r.o[i](out, residual=x)
            x = r.down[i](r.gate_up[i](h, norm=layer.post_attention_layernorm), gated=True, residual=h)
        return x

    per_op.backend._layers_in_kernels = layers
    trees = [TokenTree((30, 41, 42, 43), (-1, 0, 0, 1)), TokenTree((7, 8), (-1, 0))]
    for runner in (fused, per_op):
        runner.forward_trees([0, 1], [0, 0], [TokenTree.chain(p) for p in prompts])
    logits = [r.forward_trees([0, 1], [len(p) for p in prompts], trees) for r in (fused, per_op)]
    assert torch.equal(logits[0], logits[1])


def assert_ragged_rows_are_padded_rows(runner: NativeRunner, prompts: list[list[int]]) -> None:
    """After the two ``prompts`` are cached, trees of 4 and 2 nodes go through the layers as 6
    rows of one node, and each node's logits and captured hidden states (what EAGLE-3 reads)
    are, bit for bit, those of the same trees padded to one width (``NativeRunner.forward``);
    the padding rows of the result are zero."""
    trees = [TokenTree((30, 41, 42, 43), (-1, 0, 0, 1)), TokenTree((7, 8), (-1, 0))]
    runner.forward_trees([0, 1], [0, 0], [TokenTree.chain(p) for p in prompts])
    lens = [len(p) for p in prompts]
    shapes = []
    run_layers = runner.backend.run_layers

    def recorded(r: NativeRunner, x: torch.Tensor, at: Placement) -> torch.Tensor:
        shapes.append(tuple(x.shape[:2]))
        return run_layers(r, x, at)

    runner.backend.run_layers = recorded
    ragged = runner.forward_trees([0, 1], lens, trees, capture=(1,))
    tokens, depths, ancestors = pack_trees(trees)
    starts = torch.tensor(lens)
    padded = runner.forward([0, 1], lens, tokens, starts[:, None] + depths, starts, ancestors, capture=(1,))
    assert shapes == [(6, 1), (2, 4)]
    for part in ("logits", "features"):
        rows, expected = getattr(ragged, part), getattr(padded, part)
        for b, tree in enumerate(trees):
            assert torch.equal(rows[b, : len(tree)], expected[b, : len(tree)])
        assert not rows[1, 2:].any()


def assert_chunks_ride_along_unscored(runner: NativeRunner, prompts: list[list[int]]) -> None:
    """A tree verified in slot 0 after prompt 0, with the second half of prompt 1 prefilled in
    slot 1 in the same forward (``unscored``), gives bit for bit the logits, the captured hidden
    states and the cache entries of the two written in forwards of their own (slots 2 and 3);
    only the tree's rows are scored. The chunk is wider than the cache has room for after prompt
    0: the tree attends over its own prefix and nodes, not over the chunk's width. ``runner``
    needs four slots."""
    tree = TokenTree((30, 41, 42, 43), (-1, 0, 0, 1))
    first, second = prompts
    half = len(second) // 2
    assert len(first) + len(second) - half > runner.capacity
    for slots in ((0, 1), (2, 3)):
        runner.forward_trees(list(slots), [0, 0], [TokenTree.chain(first), TokenTree.chain(second[:half])])
    chunk = TokenTree.chain(second[half:])
    together = runner.forward_trees([0, 1], [len(first), half], [tree, chunk], capture=(1,), unscored=1)
    alone = runner.forward_trees([2], [len(first)], [tree], capture=(1,))
    chunk_alone = runner.forward_trees([3], [half], [chunk], capture=(1,))
    assert together.logits.shape == alone.logits.shape == (1, len(tree), runner.vocab_size)
    assert torch.equal(together.logits, alone.logits)
    assert torch.equal(together.features[0, : len(tree)], alone.features[0])
    assert torch.equal(together.features[1], chunk_alone.features[0])
    kv = runner.cache.kv
    assert torch.equal(kv[:, 0, :, : len(first) + len(tree)], kv[:, 2, :, : len(first) + len(tree)])
    assert torch.equal(kv[:, 1, :, : len(second)], kv[:, 3, :, : len(second)])
    assert kv[:, 1, :, : len(second)].abs().sum() > 0
