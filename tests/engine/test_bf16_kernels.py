"""multiguess's bf16 CPU kernels (engine/backends/cpu/bf16_kernel.py): products, the ops fused around them,
rotary and cache writes, attention; and why they matter: a tree node's logits are the bits of
the same token decoded alone, so bf16 speculation is token for token bf16 plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from multiguess import LLM, SamplingParams
from multiguess.engine.backends.cpu import bf16_kernel, quant_kernel
from multiguess.engine.backends.cpu.packed import PackedProjection, packing_supported
from multiguess.engine.linear import Projection, rms_norm
from multiguess.engine.placement import apply_rotary, rotary_tables
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree
from multiguess.models.loading import load_model

from tests.engine.layer_kernels import (
    assert_chunks_ride_along_unscored,
    assert_layer_kernel_is_per_op,
    assert_ragged_rows_are_padded_rows,
)
from tests.engine.test_fast_path import linear
from tests.engine.test_lossless import random_prompts

needs_kernel = pytest.mark.skipif(
    bf16_kernel.library() is None, reason="the bf16 kernels need AVX512-BF16 or AVX2, and a C compiler"
)
needs_amx = pytest.mark.skipif(
    bf16_kernel.library() is None or not bf16_kernel.amx_usable(), reason="needs AMX tiles (amx_bf16)"
)


@pytest.fixture(params=[False, pytest.param(True, marks=needs_amx)], ids=["avx512", "amx"])
def product(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Runs a test with the products on AVX512-BF16 and, where the CPU has them, on AMX tiles:
    every runner the test builds uses that side, as every runner of a process does."""
    monkeypatch.setattr(bf16_kernel, "matrix_units", lambda: request.param)
    return request.param


@needs_kernel
@pytest.mark.parametrize(("outputs", "inputs"), [([64, 64], 64), ([100, 37], 72), ([300, 212], 1536)])
def test_bf16_kernel_rows_do_not_depend_on_the_row_count(
    outputs: list[int], inputs: int, product: bool
) -> None:
    """Why a tree forward and a one-token step agree in bf16: a row is computed the same way
    alone and among 40 others (every tile size, panel tails, a bias); it is fp32 math rounded.
    The widest case has enough long sums that a row summed in another order (a tail tile's
    pairs reversed, tried) rounds differently somewhere. On AMX tiles 72 inputs (not a multiple
    of 32) take the AVX512 product, and 20 and 40 rows pad a 16-row tile. On AVX2, 8 rows and
    more take the widened product (40 rows: two groups; 1536 inputs: several slices)."""
    torch.manual_seed(2)
    layers = [linear(n, inputs, torch.bfloat16, bias=True) for n in outputs]
    projection = PackedProjection.of(layers)
    assert projection is not None and projection.panels is not None
    x = torch.randn(2, 20, inputs, dtype=torch.bfloat16)
    together = projection(x)
    for rows in (1, 2, 5, 7, 8, 13, 19):
        assert torch.equal(projection(x[:, :rows]), together[:, :rows])
    assert torch.equal(projection(x[1, 19]), together[1, 19])  # one row, 1-D input
    weight = torch.cat([m.weight for m in layers]).float()
    bias = torch.cat([m.bias for m in layers]).float()
    exact = x.float() @ weight.T + bias
    assert torch.allclose(together.float(), exact, rtol=2**-7, atol=1e-3)
    assert [part.shape[-1] for part in projection.split(x)] == outputs


@needs_kernel
def test_bf16_kernel_fuses_norm_activation_and_residual_like_the_torch_ops(product: bool) -> None:
    """The ops the kernel runs around a product give what the modules give, up to one rounding,
    with rows still independent of the row count; the residual add rounds exactly like torch."""
    torch.manual_seed(3)
    width, hidden = 96, 160
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(width)).to(torch.bfloat16))
    norm.variance_epsilon = 1e-5
    up = PackedProjection.of([linear(2 * hidden, width, torch.bfloat16)])
    down = PackedProjection.of([linear(width, hidden, torch.bfloat16)])
    assert up is not None and up.panels is not None and down is not None and down.panels is not None
    x = (3 * torch.randn(11, width)).to(torch.bfloat16)

    normed = up(x, norm=norm)
    assert torch.allclose(normed.float(), up(rms_norm(norm, x)).float(), rtol=2**-6, atol=2e-2)
    assert torch.equal(up(x[4:5], norm=norm), normed[4:5])

    gated = down(normed, gated=True)
    gate, value = normed.chunk(2, dim=-1)
    assert torch.allclose(gated.float(), down(F.silu(gate) * value).float(), rtol=2**-6, atol=2e-2)
    assert torch.equal(down(normed[7:9], gated=True), gated[7:9])

    assert torch.equal(down(normed, gated=True, residual=x), x + gated)
    eager = Projection(down.weight, None, [width])
    assert torch.allclose(
        eager(normed, gated=True, residual=x).float(), (x + gated).float(), rtol=2**-6, atol=5e-2
    )


def test_bf16_kernel_build_failure_falls_back_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(bf16_kernel, "cpu_variant", lambda: "avx2")
    monkeypatch.setenv("MULTIGUESS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert bf16_kernel.library.__wrapped__() is None
    assert "bf16 kernel unavailable, using oneDNN" in caplog.text
    assert not list((tmp_path / "kernels").iterdir())  # no half-written library left behind
    monkeypatch.setenv("MULTIGUESS_BF16_KERNEL", "0")
    assert bf16_kernel.library.__wrapped__() is None


LIBRARIES = [
    (sources, variant) for sources in (bf16_kernel.BF16, quant_kernel.QUANT) for variant in sources.variants
]


@pytest.mark.skipif(bf16_kernel.find_compiler() is None, reason="needs a C compiler")
@pytest.mark.parametrize(("sources", "variant"), LIBRARIES, ids=[f"{s.name}-{v}" for s, v in LIBRARIES])
def test_every_variant_builds_on_any_cpu(
    sources: bf16_kernel.Sources, variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image bakes every variant of each library on whatever CPU builds it, so each must
    compile anywhere, under its own name (a CPU loads the one it runs). Where a compiler exists
    this fails on a source that does not compile, which the kernels' own tests would skip."""
    monkeypatch.setenv("MULTIGUESS_CACHE_DIR", str(tmp_path))
    compiler = bf16_kernel.find_compiler()
    assert compiler is not None
    built = bf16_kernel.build(compiler, variant, sources)
    assert built.exists() and built.stat().st_size > 0 and f"-{variant}-" in built.name
    others = {bf16_kernel.compiled_path(name, sources).name for name in sources.variants}
    assert len(others) == len(sources.variants)


def test_the_variant_is_the_best_the_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [
        ({"avx2", "fma", "avx512_bf16"}, "avx512"),
        ({"avx2", "fma"}, "avx2"),
        ({"avx2"}, None),
        (set(), None),
    ]
    for cpu, expected in cases:
        monkeypatch.setattr(bf16_kernel, "cpu_flags", lambda cpu=cpu: frozenset(cpu))
        assert bf16_kernel.cpu_variant() == expected


def test_odd_input_width_falls_back_to_onednn() -> None:
    kind = PackedProjection if packing_supported(torch.bfloat16) else Projection
    projection = kind.of([linear(8, 7, torch.bfloat16)])
    assert projection is not None and getattr(projection, "panels", None) is None
    x = torch.randn(3, 7, dtype=torch.bfloat16)
    assert torch.allclose(projection(x).float(), F.linear(x, projection.weight).float(), rtol=2**-7)


@needs_kernel
def test_rotary_and_cache_write_are_bitwise_the_torch_ops() -> None:
    torch.manual_seed(4)
    batch, width, heads, kv_heads, dim, capacity = 2, 3, 4, 2, 16, 12
    qkv = torch.randn(batch, width, heads + 2 * kv_heads, dim).to(torch.bfloat16)
    cos, sin = torch.randn(2, batch, width, dim).to(torch.bfloat16)
    cache = torch.zeros(3, 2 * kv_heads, capacity, dim, dtype=torch.bfloat16)
    slots, starts = torch.tensor([2, 0]), torch.tensor([5, 1])
    queries = bf16_kernel.rope_into_cache(
        qkv, *(t[:, :, 0] for t in rotary_tables(cos, sin)), cache, slots, starts, heads
    )

    rotated = apply_rotary(qkv[:, :, : heads + kv_heads], *rotary_tables(cos, sin)).float()
    assert torch.equal(queries, rotated[:, :, :heads])
    for b, (slot, start) in enumerate(zip(slots.tolist(), starts.tolist(), strict=True)):
        written = cache[slot, :, start : start + width].transpose(0, 1).float()
        assert torch.equal(written[:, :kv_heads], rotated[b, :, heads:])
        assert torch.equal(written[:, kv_heads:], qkv[b, :, heads + kv_heads :].float())
    assert cache[1].abs().sum() == 0  # an unused slot stays untouched


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 128), (4, 2, 32)])
def test_attention_of_keys_scattered_among_hidden_ones_is_that_of_the_keys_side_by_side(
    heads: int, kv_heads: int, dim: int
) -> None:
    """A tree node's ancestors sit in the cache with its siblings between them, which its mask
    hides; decoded alone, the same keys sit side by side. Both must give the same bits: hidden
    keys may shift the visible ones to other places, even by an odd number of slots, and change
    nothing (a sum split by the keys' places would round differently now and then)."""
    generator = torch.Generator().manual_seed(11)
    visible, hidden = 300, 200
    keys = torch.randn(2 * kv_heads, visible, dim, generator=generator).to(torch.bfloat16)
    queries = torch.randn(1, 1, heads, dim, generator=generator) * 3
    side_by_side = torch.zeros(1, 2 * kv_heads, visible + hidden, dim, dtype=torch.bfloat16)
    side_by_side[0, :, :visible] = keys
    alone = bf16_kernel.attention(
        queries, side_by_side, torch.tensor([0]), torch.zeros(1, 1, visible), dim**-0.5, visible
    )
    for trial in range(400):
        places = torch.randperm(visible + hidden, generator=generator)[:visible].sort().values
        scattered = torch.randn(1, 2 * kv_heads, visible + hidden, dim, generator=generator).to(
            torch.bfloat16
        )
        scattered[0, :, places] = keys
        mask = torch.full((1, 1, visible + hidden), float("-inf"))
        mask[0, 0, places] = 0.0
        out = bf16_kernel.attention(queries, scattered, torch.tensor([0]), mask, dim**-0.5, visible + hidden)
        assert torch.equal(out, alone), f"trial {trial}"


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (4, 2, 32), (14, 2, 64)])
def test_attention_matches_scaled_dot_product_attention(heads: int, kv_heads: int, dim: int) -> None:
    torch.manual_seed(5)
    batch, width, capacity, length = 2, 5, 40, 33
    queries = torch.randn(batch, width, heads, dim)
    cache = torch.randn(4, 2 * kv_heads, capacity, dim).to(torch.bfloat16)
    slots = torch.tensor([3, 1])
    visible = torch.rand(batch, width, length) < 0.6
    visible[..., 0] = True  # every row sees at least one key
    mask = torch.zeros(batch, width, length).masked_fill_(~visible, float("-inf"))
    out = bf16_kernel.attention(queries, cache, slots, mask, dim**-0.5, length)

    kv = cache[slots, :, :length].float()
    keys = kv[:, :kv_heads].repeat_interleave(heads // kv_heads, 1)
    values = kv[:, kv_heads:].repeat_interleave(heads // kv_heads, 1)
    expected = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, mask[:, None])
    expected = expected.transpose(1, 2).reshape(batch, width, heads * dim)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected, rtol=2**-7, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dim", [64, 128, 32])
def test_a_heads_attention_is_the_same_bits_whichever_heads_share_its_pass(dim: int) -> None:
    """Query heads of one key/value head are attended together, a few at a time (7 heads: 4 and
    3 on AVX-512); each head's output is the bits of that head attended alone."""
    generator = torch.Generator().manual_seed(12)
    heads, length = 7, 70
    queries = torch.randn(2, 3, heads, dim, generator=generator)
    cache = torch.randn(1, 2, length, dim, generator=generator).to(torch.bfloat16)
    mask = torch.zeros(2, 3, length).masked_fill_(
        torch.rand(2, 3, length, generator=generator) < 0.3, float("-inf")
    )
    mask[..., 0] = 0.0
    slots = torch.tensor([0, 0])
    together = bf16_kernel.attention(queries, cache, slots, mask, dim**-0.5, length).view(2, 3, heads, dim)
    for h in range(heads):
        alone = bf16_kernel.attention(
            queries[:, :, h : h + 1].contiguous(), cache, slots, mask, dim**-0.5, length
        )
        assert torch.equal(alone.view(2, 3, dim), together[:, :, h]), f"head {h}"


# Trees whose paths skip siblings, so a node's ancestors sit in the cache with gaps between them
# where decoding the path alone puts them side by side: (tokens, parents, the path's nodes).
GAPPED_TREES = [
    ((30, 41, 42, 43, 50), (-1, 0, 0, 1, 3), (0, 1, 3, 4)),
    (
        (30, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58),
        (-1, 0, 0, 0, 2, 2, 5, 5, 5, 7, 7, 9, 9, 9, 12, 12, 14, 14, 16),
        (0, 2, 5, 7, 9, 12, 14, 16, 18),
    ),
]


@needs_kernel
@pytest.mark.parametrize("prompt_length", [300, 45, 16])
@pytest.mark.parametrize(("tokens", "parents", "path"), GAPPED_TREES)
def test_tree_rows_are_the_bits_of_tokens_decoded_alone(
    gqa_pair: tuple[Path, Path],
    product: bool,
    prompt_length: int,
    tokens: tuple[int, ...],
    parents: tuple[int, ...],
    path: tuple[int, ...],
) -> None:
    """A tree verified beside another sequence gives each node the logits, bit for bit, that
    decoding its path one token at a time alone gives, whatever the prefix's length and however
    far apart the path's nodes sit among their siblings. With torch's attention instead, 3 of
    the first tree's 4 nodes differ in their last bits (checked when the test was written)."""
    loaded = load_model(str(gqa_pair[0]), dtype="bfloat16")
    together, alone = NativeRunner(loaded, 3, 512), NativeRunner(loaded, 3, 512)
    assert together.backend.layer_kernels
    prompt, other = random_prompts(6, (prompt_length, 11))
    together.forward_trees([0], [0], [TokenTree.chain(other)])
    together.forward_trees([1], [0], [TokenTree.chain(prompt)])
    tree = TokenTree(tokens, parents)
    verified = together.forward_trees([1, 0], [len(prompt), len(other)], [tree, TokenTree((7, 8), (-1, 0))])[
        0
    ]

    alone.forward_trees([2], [0], [TokenTree.chain(prompt)])
    for depth, node in enumerate(path):
        step = alone.forward_trees([2], [len(prompt) + depth], [TokenTree.chain([tree.tokens[node]])])
        assert torch.equal(step[0, 0], verified[node]), f"node {node} at depth {depth}"


@needs_kernel
def test_the_layer_kernels_cache_is_bf16_and_torchs_is_fp32(gqa_pair: tuple[Path, Path]) -> None:
    """The layer kernels write bf16 keys and values, so their cache holds them in bf16 (half the
    bytes a position); where torch attends (``eager``: no packed panels) the cache stays fp32.
    The first layer's keys and values, products of the same embeddings, are the same values up
    to the products' rounding (one bf16 step); later layers' inputs drift apart as products
    round otherwise (AVX2's against oneDNN's), so they are not compared."""
    loaded = load_model(str(gqa_pair[0]), dtype="bfloat16")
    kernels, torch_path = NativeRunner(loaded, 2, 64), NativeRunner(loaded, 2, 64, eager=True)
    assert kernels.backend.layer_kernels and not torch_path.backend.layer_kernels
    assert kernels.cache.kv.dtype == torch.bfloat16 and torch_path.cache.kv.dtype == torch.float32
    assert 2 * kernels.cache.bytes_per_token == torch_path.cache.bytes_per_token
    prompt = random_prompts(15, (20,))[0]
    for runner in (kernels, torch_path):
        runner.forward_trees([1], [0], [TokenTree.chain(prompt)])
    written, reference = (
        kernels.cache.kv[:, 1, :, : len(prompt)].float(),
        torch_path.cache.kv[:, 1, :, : len(prompt)],
    )
    assert all(layer.abs().sum() > 0 for layer in written)
    assert torch.allclose(written[0], reference[0], rtol=2**-7, atol=1e-6)


@needs_kernel
def test_trees_of_different_sizes_verify_a_node_per_row_as_if_padded(
    gqa_pair: tuple[Path, Path], product: bool
) -> None:
    runner = NativeRunner(load_model(str(gqa_pair[0]), dtype="bfloat16"), 2, 256)
    assert runner.backend.layer_kernels and runner.backend.ragged_rows
    assert_ragged_rows_are_padded_rows(runner, random_prompts(14, (40, 9)))


@needs_kernel
def test_a_prompt_chunk_rides_along_a_verification_unscored(
    gqa_pair: tuple[Path, Path], product: bool
) -> None:
    runner = NativeRunner(load_model(str(gqa_pair[0]), dtype="bfloat16"), 4, 256)
    assert runner.backend.ragged_rows
    assert_chunks_ride_along_unscored(runner, random_prompts(16, (200, 120)))


@needs_kernel
@pytest.mark.parametrize(("num_candidates", "depth"), [(1, 4), (3, 3)])
def test_bf16_speculation_equals_bf16_plain_decoding(
    gqa_pair: tuple[Path, Path], num_candidates: int, depth: int, product: bool
) -> None:
    target, draft = gqa_pair
    prompts = random_prompts(12, (1, 7, 30, 200))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = LLM(str(target), None, dtype="bfloat16", max_batch=4)
    spec = LLM(str(target), str(draft), num_candidates, depth, dtype="bfloat16", max_batch=4, adaptive=False)
    assert spec.engine.target.backend.layer_kernels
    outputs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in (plain, spec)]
    assert outputs[0] == outputs[1]


@needs_kernel
def test_layer_kernel_equals_the_per_op_kernels(gqa_pair: tuple[Path, Path], product: bool) -> None:
    """One call per layer computes, bit for bit, what the six per-op kernels compose to (norms,
    epsilons, biases and residuals wired right), for a batch of trees after cached prefixes."""
    loaded = load_model(str(gqa_pair[0]), dtype="bfloat16")
    fused, per_op = NativeRunner(loaded, 2, 256), NativeRunner(loaded, 2, 256)
    assert fused.backend.layer_kernels

    assert_layer_kernel_is_per_op(fused, per_op, random_prompts(13, (40, 9)))


@needs_amx
def test_amx_products_are_the_avx512_products_up_to_summation_order() -> None:
    """Both sides sum each output's pairs in fp32, but the tiles round inside a pair otherwise
    than vdpbf16ps: about one output in 10,000 differs in its last bit, so the two sides are
    both within a bf16 rounding of the exact product, and not the same arithmetic (else the
    tests above would prove nothing about the tiles)."""
    torch.manual_seed(6)
    weight, bias = torch.randn(1536, 1536).to(torch.bfloat16), torch.randn(1536).to(torch.bfloat16)
    panels, x = bf16_kernel.pack(weight), torch.randn(40, 1536).to(torch.bfloat16)
    tiles, vectors = (bf16_kernel.matmul(panels, 1536, x, bias, amx=amx).float() for amx in (True, False))
    exact = x.float() @ weight.float().T + bias.float()
    for result in (tiles, vectors):
        assert torch.allclose(result, exact, rtol=2**-7, atol=1e-2)
    assert not torch.equal(tiles, vectors)


def test_product_choice_follows_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``avx512`` never takes the tiles, ``amx`` takes them exactly where they are usable, and
    a misspelt setting is refused rather than ignored."""
    for setting, expected in (("avx512", False), ("amx", bf16_kernel.amx_usable())):
        monkeypatch.setenv(bf16_kernel.PRODUCT, setting)
        assert bf16_kernel.matrix_units.__wrapped__() is expected
    monkeypatch.setenv(bf16_kernel.PRODUCT, "tiles")
    with pytest.raises(ValueError, match="auto, amx or avx512"):
        bf16_kernel.matrix_units.__wrapped__()
