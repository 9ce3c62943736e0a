"""The runner captures the hidden states entering chosen layers: transformers' own
``output_hidden_states`` at the same positions, on the torch path and the CPU kernel path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess.engine.runner import Captured, NativeRunner
from multiguess.engine.tree import TokenTree
from multiguess.models.loading import load_model
from transformers import AutoModelForCausalLM


def reference(folder: Path, ids: list[int], layers: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        states = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1).float()


def test_torch_path_captures_transformers_hidden_states(tiny_llama: Path) -> None:
    loaded = load_model(str(tiny_llama), dtype="float32", device="cpu")
    runner = NativeRunner(loaded, num_slots=2, capacity=64, eager=True)
    layers = (1, 0, 1)  # any order, repeats allowed: concatenated as asked
    prompt = [5, 9, 13, 21, 8, 30, 11]
    plain = runner.forward_trees([1], [0], [TokenTree.chain(prompt)])
    assert isinstance(plain, torch.Tensor)  # nothing captured unless asked
    out = runner.forward_trees([1], [0], [TokenTree.chain(prompt)], last_only=True, capture=layers)
    assert isinstance(out, Captured) and out.logits.shape[0] == 1
    torch.testing.assert_close(out.features[0], reference(tiny_llama, prompt, layers, torch.float32))
    # A tree after the prompt: every node's features are those of its own path.
    tree = TokenTree((40, 41, 42, 43), (-1, 0, 0, 1))
    nodes = runner.forward_trees([1], [len(prompt)], [tree], capture=layers).features[0]
    for node, path in enumerate(([40], [40, 41], [40, 42], [40, 41, 43])):
        expected = reference(tiny_llama, prompt + path, layers, torch.float32)[-1]
        torch.testing.assert_close(nodes[node], expected)
    with pytest.raises(ValueError, match="cannot capture layers"):
        runner.forward_trees([0], [0], [TokenTree.chain(prompt)], capture=(5,))


def test_kernel_path_captures_transformers_hidden_states(gqa_pair: tuple[Path, Path]) -> None:
    target, _ = gqa_pair
    loaded = load_model(str(target), dtype="bfloat16", device="cpu")
    runner = NativeRunner(loaded, num_slots=2, capacity=64)
    if not getattr(runner.backend, "layer_kernels", False):
        pytest.skip("this CPU has no multiguess bf16 layer kernels (AVX512-BF16)")
    layers = (1, 2, 3)
    prompt = [5, 9, 13, 21, 8, 30, 11, 17, 4]
    out = runner.forward_trees([0], [0], [TokenTree.chain(prompt)], capture=layers)
    expected = reference(target, prompt, layers, torch.bfloat16)
    # bf16 kernels round differently from transformers' bf16 forward: close, not bitwise.
    torch.testing.assert_close(out.features[0].float(), expected, atol=0.1, rtol=0.05)
    eager = NativeRunner(loaded, num_slots=2, capacity=64, eager=True)
    torch.testing.assert_close(
        eager.forward_trees([0], [0], [TokenTree.chain(prompt)], capture=layers).features.float(),
        out.features.float(),
        atol=0.1,
        rtol=0.05,
    )
    per_layer = out.features[0].float().split(loaded.model.config.hidden_size, dim=-1)
    assert not torch.allclose(per_layer[0], per_layer[2])  # copies, not one buffer updated in place
