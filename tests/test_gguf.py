"""GGUF files load natively: quantized linears stay in their blocks and decode to what the
``gguf`` package's reference dequantizer gives (through transformers' own GGUF loading, which
dequantizes every tensor with it); unsupported architectures and formats fail clearly."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from multiguess.benchmark import weight_bytes
from multiguess.engine.quantized import (
    FORMATS,
    QuantizedEmbedding,
    QuantizedLinear,
    dequantize,
    format_for,
    quantize,
)
from multiguess.errors import UnsupportedModelError
from multiguess.models.loading import load_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.gguf_files import K_SIZES, tiny_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Converted metadata goes to the test's own cache folder."""
    monkeypatch.setenv("MULTIGUESS_CACHE_DIR", str(tmp_path / "cache"))


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("kind", list(FORMATS))
def test_dequantize_matches_the_reference(kind: str) -> None:
    """Blocks written here decode, bit for bit, to what the gguf package decodes (its reader
    is ggml's layout), and close to the weight they were written from."""
    weight = torch.randn(48, 512, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 512)
    blocks = quantize(weight, kind)
    reference = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks.numpy(), FORMATS[kind])))
    assert torch.equal(dequantize(blocks, kind), reference)
    error = ((reference - weight).norm(dim=1) / weight.norm(dim=1)).max()
    assert error < {"q8_0": 0.01, "q6_k": 0.03}.get(kind, 0.15)


def test_k_formats_fall_back_where_rows_are_not_whole_super_blocks(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path, "llama", Q.F32, hidden_size=256, intermediate_size=96)
    for kind, fallback in (("q4_k", "q4_1"), ("q6_k", "q8_0")):
        model = load_model(str(path.parent / "llama-source"), device="cpu", quantization=kind).model
        layer = model.model.layers[0]
        assert layer.self_attn.q_proj.kind == layer.mlp.up_proj.kind == kind
        assert layer.mlp.down_proj.kind == fallback  # 96 inputs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K])
def test_loaded_gguf_is_the_dequantized_reference(tmp_path: Path, family: str, qtype: Q) -> None:
    sizes = K_SIZES if qtype in (Q.Q4_K, Q.Q6_K) else {}
    path = tiny_gguf(
        tmp_path, family, qtype, embed_qtype=Q.Q8_0, tie_word_embeddings=family == "llama", **sizes
    )
    loaded = load_model(str(path), dtype="float32", device="cpu")
    model = loaded.model
    reference = AutoModelForCausalLM.from_pretrained(  # transformers reads no head_dim from Qwen3 files
        str(path.parent), gguf_file=path.name, dtype=torch.float32, config=model.config
    )
    assert loaded.dtype == torch.float32 and isinstance(model.model.embed_tokens, QuantizedEmbedding)
    for layer, ref in zip(model.model.layers, reference.model.layers, strict=True):
        for name in LINEARS:
            where = f"self_attn.{name}" if name[0] in "qkvo" else f"mlp.{name}"
            module, expected = layer.get_submodule(where), ref.get_submodule(where)
            kind = format_for(qtype.name.lower(), module.in_features)  # Qwen3's o_proj reads 64 inputs
            assert isinstance(module, QuantizedLinear) and module.kind == kind
            assert torch.equal(dequantize(module.blocks, module.kind), expected.weight)
            if expected.bias is not None:
                assert torch.equal(module.bias, expected.bias)
    assert isinstance(model.lm_head, QuantizedLinear)
    assert torch.equal(dequantize(model.lm_head.blocks, model.lm_head.kind), reference.lm_head.weight)
    ids = loaded.tokenizer('w1 hello {"name": true}', return_tensors="pt").input_ids
    assert ids.tolist() == reference_tokens(path, 'w1 hello {"name": true}')
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def reference_tokens(path: Path, text: str) -> list[list[int]]:
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)(
        text, return_tensors="pt"
    ).input_ids.tolist()


def test_float_gguf_loads_as_plain_linears(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path, "qwen2", Q.F32)
    model = load_model(str(path), device="cpu").model
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert type(model.model.embed_tokens) is torch.nn.Embedding


def test_unsupported_architecture_names_the_supported(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with pytest.raises(
        UnsupportedModelError, match="'phi2' is not supported; supported: llama, qwen2, qwen3"
    ):
        load_model(str(path), device="cpu")


def test_unsupported_format_names_the_tensor_and_the_supported(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path, "qwen2", Q.Q5_0)
    with pytest.raises(
        UnsupportedModelError,
        match=r"is Q5_0, .* supported tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K",
    ):
        load_model(str(path), device="cpu")


def test_gguf_blocks_on_a_gpu_are_refused_clearly(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path, "qwen2", Q.Q8_0)
    with pytest.raises(UnsupportedModelError, match=r"GGUF blocks run on CPUs only.*--quantization none"):
        load_model(str(path), device="cuda")


def test_a_gguf_is_not_quantized_again(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path, "qwen2", Q.Q8_0)
    with pytest.raises(ValueError, match="quantized already"):
        load_model(str(path), device="cpu", quantization="q4_0")


def test_quantization_none_dequantizes_a_gguf(tmp_path: Path) -> None:
    """Float weights, as transformers decodes them, and the same tokenizer as the blocks' load:
    the path a GGUF takes to a GPU."""
    path = tiny_gguf(tmp_path, "llama", Q.Q4_1, embed_qtype=Q.Q8_0)
    loaded = load_model(str(path), dtype="float32", device="cpu", quantization="none")
    blocks = load_model(str(path), dtype="float32", device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    q = loaded.model.model.layers[0].self_attn.q_proj
    assert type(q) is torch.nn.Linear and loaded.dtype == torch.float32
    assert torch.equal(q.weight, reference.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(q.weight, dequantize(blocks.model.model.layers[0].self_attn.q_proj.blocks, "q4_1"))
    assert loaded.tokenizer.get_vocab() == blocks.tokenizer.get_vocab()


def test_safetensors_quantized_at_load(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path, "llama", Q.F32)
    source = path.parent / "llama-source"
    model = load_model(str(source), device="cpu", quantization="q4_1").model
    q = model.model.layers[0].self_attn.q_proj
    plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.kind == "q4_1"
    assert torch.equal(q.blocks, quantize(plain.weight, "q4_1"))


def test_the_benchmark_counts_the_blocks_a_step_reads(tmp_path: Path) -> None:
    """``multiguess bench``'s bandwidth bound reads quantized weights' blocks, not only parameters."""
    path = tiny_gguf(tmp_path, "llama", Q.Q4_1)
    model = load_model(str(path), device="cpu").model
    blocks = sum(m.blocks.numel() for m in model.modules() if isinstance(m, QuantizedLinear))
    source = AutoModelForCausalLM.from_pretrained(path.parent / "llama-source", dtype=torch.float32)
    assert blocks < weight_bytes(model) < weight_bytes(source) / 4
