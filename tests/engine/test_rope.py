"""The rotary tables a forward reads (``placement.Rope``): gathered from tables computed once
where the rope is fixed in advance, they are the model's rotary module's evaluation bit for
bit; a rope that rescales with the sequence (dynamic) is evaluated for every forward."""

from __future__ import annotations

import pytest
import torch
from multiguess.engine.placement import Rope, rotary_tables
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(ROPES))
def test_rotary_tables_are_the_rotary_modules_own(kind: str, dtype: torch.dtype) -> None:
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=128, rope_parameters=ROPES[kind]
    )
    rotary = LlamaRotaryEmbedding(config)
    rope = Rope(rotary, 300, dtype, torch.device("cpu"))
    assert (rope.table is None) == (kind == "dynamic")
    for seed in range(3):  # past max_position_embeddings too, where a dynamic rope rescales
        positions = torch.randint(0, 300, (3, 5), generator=torch.Generator().manual_seed(seed))
        x = torch.zeros(3, 5, 64, dtype=dtype)
        gathered, evaluated = rope(x, positions), rotary_tables(*rotary(x, positions))
        assert all(torch.equal(a, b) for a, b in zip(gathered, evaluated, strict=True))
        assert gathered[0].shape == (3, 5, 1, 16) and gathered[0].dtype == dtype


def test_runners_over_one_rotary_module_share_its_tables() -> None:
    """Two runners over one model rotate by the same tensors, not by two evaluations of the
    module, which torch's elementwise kernels do not always return alike; another length,
    dtype or module gets its own."""
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128)
    rotary, other = LlamaRotaryEmbedding(config), LlamaRotaryEmbedding(config)
    cpu = torch.device("cpu")
    first, second = Rope(rotary, 300, torch.bfloat16, cpu), Rope(rotary, 300, torch.bfloat16, cpu)
    assert first.table is not None and second.table is not None
    assert all(a is b for a, b in zip(first.table, second.table, strict=True))
    for rope in (
        Rope(rotary, 200, torch.bfloat16, cpu),
        Rope(rotary, 300, torch.float32, cpu),
        Rope(other, 300, torch.bfloat16, cpu),
    ):
        assert rope.table is not None and rope.table[0] is not first.table[0]
