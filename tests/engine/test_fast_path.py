"""The fast path (prepacked CPU weights, fused projections) against the eager path and transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from multiguess import LLM, SamplingParams
from multiguess.engine import bf16_kernel
from multiguess.engine.linear import Projection, packing_supported, rms_norm
from multiguess.engine.runner import NativeRunner, attention, fold_mask
from multiguess.engine.tree import TokenTree
from multiguess.models.loading import load_model
from transformers import AutoModelForCausalLM

from tests.engine.test_lossless import random_prompts
from tests.tiny_models import build_tokenizer, model_config, save_model

CPU = torch.device("cpu")


def linear(out_features: int, in_features: int, dtype: torch.dtype, bias: bool = False) -> torch.nn.Linear:
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    return layer.to(dtype)


@pytest.mark.skipif(not packing_supported(CPU, torch.bfloat16), reason="no oneDNN bf16 on this CPU")
def test_onednn_bf16_projection_is_bitwise_f_linear_for_every_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bf16_kernel, "usable", lambda weight: False)  # where the kernel cannot build
    torch.manual_seed(0)
    layers = [linear(96, 64, torch.bfloat16), linear(32, 64, torch.bfloat16)]
    plain = [m.weight.clone() for m in layers]
    projection = Projection.of(layers, pack=True)
    assert projection is not None and projection.packed is not None and projection.panels is None
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    for rows in (1, 2, 7, 16):
        first, second = projection.split(x[:, :rows])
        assert torch.equal(first, F.linear(x[:, :rows], plain[0]))
        assert torch.equal(second, F.linear(x[:, :rows], plain[1]))


@pytest.mark.skipif(
    bf16_kernel.library() is None, reason="the bf16 kernel needs AVX512-BF16 and a C compiler"
)
@pytest.mark.parametrize(("outputs", "inputs"), [([64, 64], 64), ([100, 37], 72), ([300, 212], 1536)])
def test_bf16_kernel_rows_do_not_depend_on_the_row_count(outputs: list[int], inputs: int) -> None:
    """Why a tree forward and a one-token step agree in bf16: a row is computed the same way
    alone and among 40 others (every tile size, panel tails, a bias); it is fp32 math rounded.
    The widest case has enough long sums that a row summed in another order (a tail tile's
    pairs reversed, tried) rounds differently somewhere."""
    torch.manual_seed(2)
    layers = [linear(n, inputs, torch.bfloat16, bias=True) for n in outputs]
    projection = Projection.of(layers, pack=True)
    assert projection is not None and projection.panels is not None
    x = torch.randn(2, 20, inputs, dtype=torch.bfloat16)
    together = projection(x)
    for rows in (1, 2, 5, 7, 13):
        assert torch.equal(projection(x[:, :rows]), together[:, :rows])
    assert torch.equal(projection(x[1, 19]), together[1, 19])  # one row, 1-D input
    weight = torch.cat([m.weight for m in layers]).float()
    bias = torch.cat([m.bias for m in layers]).float()
    exact = x.float() @ weight.T + bias
    assert torch.allclose(together.float(), exact, rtol=2**-7, atol=1e-3)
    assert [part.shape[-1] for part in projection.split(x)] == outputs


@pytest.mark.skipif(
    bf16_kernel.library() is None, reason="the bf16 kernel needs AVX512-BF16 and a C compiler"
)
def test_bf16_kernel_fuses_norm_activation_and_residual_like_the_torch_ops() -> None:
    """The ops the kernel runs around a product give what the modules give, up to one rounding,
    with rows still independent of the row count; the residual add rounds exactly like torch."""
    torch.manual_seed(3)
    width, hidden = 96, 160
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(width)).to(torch.bfloat16))
    norm.variance_epsilon = 1e-5
    up = Projection.of([linear(2 * hidden, width, torch.bfloat16)], pack=True)
    down = Projection.of([linear(width, hidden, torch.bfloat16)], pack=True)
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
    eager = Projection(down.weight, None, [width], pack=False)
    assert torch.allclose(
        eager(normed, gated=True, residual=x).float(), (x + gated).float(), rtol=2**-6, atol=5e-2
    )


@pytest.mark.skipif(
    bf16_kernel.library() is None, reason="the bf16 kernel needs AVX512-BF16 and a C compiler"
)
def test_rotary_and_cache_write_in_the_kernel_are_bitwise_the_torch_ops(tiny_llama: Path) -> None:
    """Two runners over one bf16 model, one writing rotary keys and values with torch ops: the
    same logits and caches after prefills into scattered slots and a batch of two trees."""
    loaded = load_model(str(tiny_llama), dtype="bfloat16")
    fused, plain = NativeRunner(loaded, 4, 64), NativeRunner(loaded, 4, 64)
    assert fused.rope_in_kernel
    plain.rope_in_kernel = False
    prompts = random_prompts(5, (9, 14))
    trees = [TokenTree((3, 7, 8, 9), (-1, 0, 0, 1)), TokenTree((4, 5), (-1, 0))]
    logits: dict[bool, list[torch.Tensor]] = {}
    for runner in (fused, plain):
        logits[runner.rope_in_kernel] = [
            runner.forward_trees([3], [0], [TokenTree.chain(prompts[0])], last_only=True),
            runner.forward_trees([1], [0], [TokenTree.chain(prompts[1])], last_only=True),
            runner.forward_trees([3, 1], [len(p) for p in prompts], trees),
        ]
    for a, b in zip(logits[True], logits[False], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fused.cache.kv, plain.cache.kv) and fused.cache.kv.abs().sum() > 0


def test_bf16_kernel_build_failure_falls_back_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(bf16_kernel, "cpu_has_avx512_bf16", lambda: True)
    monkeypatch.setenv("MULTIGUESS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert bf16_kernel.library.__wrapped__() is None
    assert "bf16 kernel unavailable, using oneDNN" in caplog.text
    assert not list((tmp_path / "kernels").iterdir())  # no half-written library left behind
    monkeypatch.setenv("MULTIGUESS_BF16_KERNEL", "0")
    assert bf16_kernel.library.__wrapped__() is None


def test_odd_input_width_falls_back_to_onednn() -> None:
    projection = Projection.of([linear(8, 7, torch.bfloat16)], pack=packing_supported(CPU, torch.bfloat16))
    assert projection is not None and projection.panels is None
    x = torch.randn(3, 7, dtype=torch.bfloat16)
    assert torch.allclose(projection(x).float(), F.linear(x, projection.weight).float(), rtol=2**-7)


@pytest.mark.skipif(not packing_supported(CPU, torch.float32), reason="no oneDNN on this build")
def test_packed_fp32_projection_matches_f_linear_with_bias() -> None:
    torch.manual_seed(1)
    layer = linear(48, 64, torch.float32, bias=True)
    projection = Projection.of([layer], pack=True)
    x = torch.randn(3, 5, 64)
    assert torch.allclose(projection(x), layer(x), atol=1e-5)
    assert torch.allclose(projection(x[:, 0]), layer(x[:, 0]), atol=1e-5)  # 2-D input (the lm head)


def test_fused_layers_keep_working_as_modules_and_runners_share_them(tiny_llama: Path) -> None:
    loaded = load_model(str(tiny_llama), dtype="float32")
    x = torch.randn(1, 3, loaded.model.config.hidden_size)
    attn = loaded.model.model.layers[0].self_attn
    before = attn.k_proj(x)
    first, second = NativeRunner(loaded, 1, 64), NativeRunner(loaded, 1, 64)
    assert torch.equal(attn.k_proj(x), before)
    assert first.qkv[0] is second.qkv[0] and first.head is second.head
    assert attn.k_proj.weight.data_ptr() != attn.q_proj.weight.data_ptr()  # views into one fused tensor
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_path_equals_eager_path_token_for_token(
    tiny_llama: Path, tiny_llama_draft: Path, dtype: str
) -> None:
    prompts = random_prompts(11, (1, 9, 40, 100))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = {}
    for eager in (False, True):
        llm = LLM(str(tiny_llama), str(tiny_llama_draft), 3, 4, dtype=dtype, adaptive=False, eager=eager)
        assert llm.engine.target.packed is (not eager and packing_supported(CPU, llm.engine.target.dtype))
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs[False] == outputs[True]


@pytest.fixture(scope="module")
def family_pair(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, Path]:
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    tokenizer = build_tokenizer()
    target = save_model(folder / "target", model_config(family, len(tokenizer)), 5, tokenizer)
    draft = save_model(
        folder / "draft", model_config(family, len(tokenizer), num_hidden_layers=1), 6, tokenizer
    )
    return target, draft


@pytest.mark.parametrize("family_pair", ["qwen3", "mistral"], indirect=True)
def test_qwen3_and_mistral_speculation_matches_transformers(family_pair: tuple[Path, Path]) -> None:
    target, draft = family_pair
    prompts = random_prompts(12, (3, 30))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]
    llm = LLM(str(target), str(draft), 2, 3, dtype="float32", adaptive=False)
    got = [
        o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    ]
    assert got == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bitwise_transformers(dtype: torch.dtype) -> None:
    from multiguess.engine.runner import apply_rotary, rotary_tables
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(3)
    q, k = torch.randn(2, 5, 4, 16, dtype=dtype), torch.randn(2, 5, 2, 16, dtype=dtype)
    cos, sin = torch.randn(2, 5, 16, dtype=dtype), torch.randn(2, 5, 16, dtype=dtype)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    tables = rotary_tables(cos, sin)
    assert torch.equal(apply_rotary(q, *tables), expected_q)
    assert torch.equal(apply_rotary(k, *tables), expected_k)


@pytest.mark.parametrize(("heads", "kv_heads", "width"), [(9, 3, 5), (4, 2, 17), (6, 6, 3), (9, 3, 1)])
def test_folded_grouped_attention_matches_repeated_heads(heads: int, kv_heads: int, width: int) -> None:
    """Folding each key/value head's query heads into its query length is the same attention as
    repeating the key/value heads, tree masks and padding rows included."""
    torch.manual_seed(heads + width)
    batch, length, dim = 3, 40, 16
    q = torch.randn(batch, width, heads, dim)
    cache = torch.randn(batch, 2 * kv_heads, 64, dim)  # a static cache: reads are strided views
    keys, values = cache[:, :kv_heads, :length], cache[:, kv_heads:, :length]
    visible = torch.rand(batch, 1, width, length) < 0.7
    visible[..., 0] = True  # no row may be empty
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    got = attention(q, keys, values, fold_mask(mask, heads // kv_heads), 0.3)
    repeat = heads // kv_heads
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.repeat_interleave(repeat, 1),
        values.repeat_interleave(repeat, 1),
        attn_mask=mask,
        scale=0.3,
    )
    torch.testing.assert_close(got, expected.transpose(1, 2).reshape(batch, width, heads * dim))
