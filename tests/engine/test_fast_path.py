"""The fast path (prepacked CPU weights, fused projections) against the eager path and transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from multiguess import LLM, SamplingParams
from multiguess.engine.backends.cpu import bf16_kernel
from multiguess.engine.backends.cpu.backend import attention, fold_mask
from multiguess.engine.backends.cpu.packed import PackedProjection, onednn_bf16, packing_supported
from multiguess.engine.runner import NativeRunner
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


@pytest.mark.skipif(not onednn_bf16(), reason="no oneDNN bf16 on this CPU")
def test_onednn_bf16_projection_is_bitwise_f_linear_for_every_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bf16_kernel, "usable", lambda weight: False)  # where the kernel cannot build
    torch.manual_seed(0)
    layers = [linear(96, 64, torch.bfloat16), linear(32, 64, torch.bfloat16)]
    plain = [m.weight.clone() for m in layers]
    projection = PackedProjection.of(layers)
    assert projection is not None and projection.packed is not None and projection.panels is None
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    for rows in (1, 2, 7, 16):
        first, second = projection.split(x[:, :rows])
        assert torch.equal(first, F.linear(x[:, :rows], plain[0]))
        assert torch.equal(second, F.linear(x[:, :rows], plain[1]))


@pytest.mark.skipif(not packing_supported(torch.float32), reason="no oneDNN on this build")
def test_packed_fp32_projection_matches_f_linear_with_bias() -> None:
    torch.manual_seed(1)
    layer = linear(48, 64, torch.float32, bias=True)
    projection = PackedProjection.of([layer])
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
        assert llm.engine.target.backend.packed is (not eager and packing_supported(llm.engine.target.dtype))
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
    from multiguess.engine.placement import apply_rotary, rotary_tables
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
