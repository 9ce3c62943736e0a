"""Lossless against the quantized model: greedy speculation over a GGUF target (or a
safetensors model quantized at load) gives token for token what plain decoding of the same
quantized weights gives, its linears on the integer kernels."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.engine.backends import cpu_has_fast_bf16
from multiguess.engine.backends.cpu import quant_kernel
from multiguess.engine.backends.cpu.quant import QuantizedProjection
from multiguess.engine.memory_probe import weight_bytes
from multiguess.engine.quantized import QuantizedLinear
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree
from multiguess.models.loading import load_model

from tests.engine.layer_kernels import (
    assert_chunks_ride_along_unscored,
    assert_layer_kernel_is_per_op,
    assert_ragged_rows_are_padded_rows,
)
from tests.engine.test_lossless import random_prompts
from tests.gguf_files import K_SIZES, tiny_gguf
from tests.tiny_models import save_noisy_copy

Q = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(
    quant_kernel.library() is None, reason="the quantized kernels need a C compiler"
)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MULTIGUESS_CACHE_DIR", str(tmp_path / "cache"))


def draft_beside(target: Path, family: str, folder: Path) -> Path:
    """A noisy copy of the target's source model with the GGUF's own tokenizer (transformers'
    GGUF conversion adds ``<|endoftext|>``: a draft must share the target's vocabulary)."""
    draft = save_noisy_copy(target.parent / f"{family}-source", folder, noise=0.3, seed=5)
    load_model(str(target), device="cpu").tokenizer.save_pretrained(draft)
    return draft


@needs_kernel
@pytest.mark.parametrize(
    ("family", "qtype"),
    [("llama", Q.Q4_1), ("qwen2", Q.Q4_0), ("mistral", Q.Q8_0), ("qwen2", Q.Q4_K), ("llama", Q.Q6_K)],
)
@pytest.mark.parametrize(("num_candidates", "depth"), [(1, 4), (3, 3)])
def test_gguf_speculation_equals_its_plain_decoding(
    tmp_path: Path, family: str, qtype: Q, num_candidates: int, depth: int
) -> None:
    sizes = K_SIZES if qtype in (Q.Q4_K, Q.Q6_K) else {}
    target = tiny_gguf(tmp_path, family, qtype, tie_word_embeddings=family == "llama", **sizes)
    draft = draft_beside(target, family, tmp_path / "draft")
    prompts = random_prompts(12, (1, 7, 30, 200), vocab=200)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(str(target), None, max_batch=4)
    spec = LLM(str(target), str(draft), num_candidates, depth, max_batch=4, adaptive=False)
    runner = spec.engine.target
    assert all(isinstance(p, QuantizedProjection) for p in (*runner.qkv, *runner.gate_up, runner.head))
    outputs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in (plain, spec)]
    assert outputs[0] == outputs[1]


@needs_kernel
@pytest.mark.skipif(not cpu_has_fast_bf16(), reason="bf16 activations need the bf16 kernels")
def test_tree_nodes_have_the_logits_of_their_paths_decoded_alone(tmp_path: Path) -> None:
    """Why: each node of a verified tree gets, bit for bit, the logits of its path decoded one
    token at a time (products per row on the integer kernels, attention per row in the bf16
    library's kernel), next to another sequence's tree."""
    target = tiny_gguf(tmp_path, "llama", Q.Q4_1)
    loaded = load_model(str(target), device="cpu")
    tree_runner, step_runner = NativeRunner(loaded, 2, 256), NativeRunner(loaded, 2, 256)
    assert loaded.dtype == torch.bfloat16 and tree_runner.backend.quantized_layers
    prefixes = random_prompts(3, (90, 120), vocab=200)
    for runner in (tree_runner, step_runner):
        runner.forward_trees([0, 1], [0, 0], [TokenTree.chain(p) for p in prefixes])
    lens = [len(p) for p in prefixes]
    paths = [list(range(11, 19)), [5, 6, 7]]
    tree_logits = tree_runner.forward_trees([0, 1], lens, [TokenTree.chain(p) for p in paths])
    for b, path in enumerate(paths):
        for i, token in enumerate(path):
            step = step_runner.forward_trees([b], [lens[b] + i], [TokenTree.chain([token])])[0, 0]
            assert torch.equal(step, tree_logits[b, i])


@needs_kernel
@pytest.mark.skipif(not cpu_has_fast_bf16(), reason="bf16 activations need the bf16 kernels")
def test_the_layer_kernel_equals_its_kernels_called_one_by_one(tmp_path: Path) -> None:
    """One call a layer (``multiguess_quant_layer``) computes what the quantized products and
    the bf16 library's rotary and attention compute called from Python one by one."""
    target = tiny_gguf(tmp_path, "llama", Q.Q4_K, **K_SIZES)
    loaded = load_model(str(target), device="cpu")
    fused, per_op = NativeRunner(loaded, 2, 256), NativeRunner(loaded, 2, 256)
    assert fused.backend.quantized_layers

    assert_layer_kernel_is_per_op(fused, per_op, random_prompts(2, (40, 9), vocab=200))


@needs_kernel
@pytest.mark.skipif(not cpu_has_fast_bf16(), reason="bf16 activations need the bf16 kernels")
def test_trees_of_different_sizes_verify_a_node_per_row_as_if_padded(tmp_path: Path) -> None:
    runner = NativeRunner(load_model(str(tiny_gguf(tmp_path, "llama", Q.Q4_1)), device="cpu"), 2, 256)
    assert runner.backend.quantized_layers and runner.backend.ragged_rows
    assert_ragged_rows_are_padded_rows(runner, random_prompts(2, (40, 9), vocab=200))


@needs_kernel
@pytest.mark.skipif(not cpu_has_fast_bf16(), reason="bf16 activations need the bf16 kernels")
def test_a_prompt_chunk_rides_along_a_verification_unscored(tmp_path: Path) -> None:
    runner = NativeRunner(load_model(str(tiny_gguf(tmp_path, "llama", Q.Q4_1)), device="cpu"), 4, 256)
    assert runner.backend.quantized_layers
    assert_chunks_ride_along_unscored(runner, random_prompts(3, (200, 120), vocab=200))


@needs_kernel
@pytest.mark.parametrize("draft_format", [None, "q4_1"])
def test_safetensors_quantized_at_load_speculates_losslessly(
    tmp_path: Path, draft_format: str | None
) -> None:
    """A target quantized at load, and a draft in float weights or in blocks of its own."""
    source = tiny_gguf(tmp_path, "qwen2", Q.F32).parent / "qwen2-source"
    draft = save_noisy_copy(source, tmp_path / "draft", noise=0.3, seed=5)
    prompts = random_prompts(4, (3, 50), vocab=200)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLM(str(source), None, max_batch=2, quantization="q8_0")
    spec = LLM(
        str(source),
        str(draft),
        3,
        3,
        max_batch=2,
        adaptive=False,
        quantization="q8_0",
        draft_quantization=draft_format,
    )
    assert isinstance(spec.engine.target.qkv[0], QuantizedProjection)
    drafted = spec.engine.drafter.runner.qkv[0]
    assert isinstance(drafted, QuantizedProjection) == (draft_format is not None)
    outputs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in (plain, spec)]
    assert outputs[0] == outputs[1]


@needs_kernel
@pytest.mark.parametrize(("qtype", "growth"), [(Q.Q4_1, 1.1), (Q.Q6_K, 1.9)], ids=["q4_1", "q6_k"])
def test_the_repacked_weights_replace_the_blocks(tmp_path: Path, qtype: Q, growth: float) -> None:
    """Memory: once the CPU backend has repacked the linears, the modules drop their blocks, so the
    model's tensors hold the weights once (the repacked copy: Q4_1's layout is the size of its
    blocks, Q6_K's wider, its 6 bits held in bytes), not twice. What still reads a
    layer (called as a module; an LM head over part of the vocabulary) reads the repacked copy
    and gets the same bits as from the blocks."""
    sizes = K_SIZES if qtype == Q.Q6_K else {}
    target = tiny_gguf(tmp_path, "llama", qtype, tie_word_embeddings=False, **sizes)
    loaded = load_model(str(target), device="cpu")
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    blocks = sum(m.blocks.nbytes for m in linears)
    before = weight_bytes(loaded.model, set())
    inputs = [torch.randn(3, m.in_features, dtype=loaded.dtype) for m in linears]
    with torch.no_grad():
        outputs = [m(x) for m, x in zip(linears, inputs, strict=True)]
    vocab = torch.tensor([5, 0, 17, 3, 40, 41, 42])
    subset = quant_kernel.repack(loaded.model.lm_head.blocks[vocab], loaded.model.lm_head.kind)

    runner = NativeRunner(loaded, 1, 64)
    assert all(m.blocks is None for m in linears)
    projections = (*runner.qkv, *runner.o, *runner.gate_up, *runner.down, runner.head)
    repacked = sum(p.weight.data.nbytes for p in projections)
    assert weight_bytes(loaded.model, set()) == before - blocks + repacked
    assert repacked < growth * blocks
    with torch.no_grad():
        for m, x, y in zip(linears, inputs, outputs, strict=True):
            assert torch.equal(m(x), y)
    assert torch.equal(QuantizedProjection.rows(loaded.model.lm_head, vocab).weight.data, subset.data)
