"""The torch/CUDA backend, run on the CPU: fused attention without dense masks, the static
(CUDA graph) forward, and the per-device dtype rule, each against the paths they replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from multiguess import SamplingParams
from multiguess.engine.backends.cuda import attention as cuda_attention
from multiguess.engine.backends.cuda.attention import attention, causal, masked_attention
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.placement import region_attention_mask, sees_only_its_own
from multiguess.models.loading import auto_dtype, load_model

from tests.engine.test_device_hygiene import decode
from tests.engine.test_lossless import random_prompts

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def test_auto_dtype_is_bf16_only_where_the_device_computes_it_natively() -> None:
    assert auto_dtype("cuda", cuda_capability=(7, 0)) == torch.float16  # V100: bf16 is emulated
    assert auto_dtype("cuda", cuda_capability=(7, 5)) == torch.float16  # T4
    assert auto_dtype("cuda", cuda_capability=(8, 0)) == torch.bfloat16  # A100
    assert auto_dtype("cuda", cuda_capability=(9, 0)) == torch.bfloat16  # H100
    assert auto_dtype("cpu", cpu_bf16=True) == torch.bfloat16
    assert auto_dtype("cpu", cpu_bf16=False) == torch.float32


def test_only_forwards_that_see_their_own_prefix_go_without_a_mask() -> None:
    one = torch.ones(2, 1, 1, dtype=torch.bool)
    assert sees_only_its_own([7, 7], torch.tensor([7, 7]), one, 8)  # a decode step
    assert not sees_only_its_own([7, 5], torch.tensor([7, 5]), one, 8)  # ragged lengths
    chain = torch.ones(1, 4, 4, dtype=torch.bool).tril()[None][0]
    assert sees_only_its_own([0], torch.tensor([0]), chain, 4)  # a prefill from position 0
    assert not sees_only_its_own([3], torch.tensor([3]), chain, 7)  # a chain after a prefix
    tree = chain.clone()
    tree[0, 2, 1] = False  # node 2 is a sibling of node 1, not its child
    assert not sees_only_its_own([0], torch.tensor([0]), tree, 4)


@pytest.mark.parametrize(("heads", "kv_heads", "width"), [(8, 2, 1), (4, 4, 1), (6, 3, 5)])
def test_unmasked_attention_equals_the_masked_one(heads: int, kv_heads: int, width: int) -> None:
    torch.manual_seed(5)
    length = 9 if width == 1 else width
    q = torch.randn(2, width, heads, 16)
    keys, values = torch.randn(2, kv_heads, length, 16), torch.randn(2, kv_heads, length, 16)
    visible = torch.ones(2, width, width, dtype=torch.bool).tril()
    mask = region_attention_mask(torch.tensor([length - width] * 2), visible, length)
    unmasked = attention(q, keys, values, None, 0.25)
    masked = attention(q, keys, values, mask, 0.25)
    assert torch.allclose(unmasked, masked, atol=1e-6)


@pytest.fixture
def flex_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masked attention on the CPU through FlexAttention (CUDA's path, here uncompiled)."""
    monkeypatch.setattr(cuda_attention, "FLEX_DEVICES", {"cuda", "cpu"})


def tree_visibility(parents: list[int]) -> torch.Tensor:
    """``[T, T]``: node i sees itself and its ancestors (``parents[i]`` -1 for a root)."""
    seen = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] |= seen[parent]
    return seen


# (heads, kv_heads, prefix lengths per sequence, the tree every sequence verifies)
MASKED_CASES = {
    "tree, grouped heads": (8, 2, [11, 11], [-1, 0, 0, 1, 1, 2]),
    "tree, ragged batch": (4, 4, [3, 17, 9], [-1, 0, 1, 0, 3]),
    "ragged decode, grouped heads": (6, 3, [5, 130, 40, 1], [-1]),
    "ragged chunk, grouped heads": (8, 1, [0, 70], [-1, 0, 1, 2, 3, 4, 5, 6]),
}


@pytest.mark.parametrize("case", MASKED_CASES, ids=list(MASKED_CASES))
def test_masked_attention_equals_sdpa_with_the_mask(case: str, flex_on_cpu: None) -> None:
    """The FlexAttention path (block mask, grouped heads in place) computes what SDPA with the
    dense bool mask computes, for trees, ragged batches and grouped heads, in float32."""
    heads, kv_heads, prefix, parents = MASKED_CASES[case]
    torch.manual_seed(7)
    batch, width = len(prefix), len(parents)
    length = max(prefix) + width
    q = torch.randn(batch, width, heads, 16)
    keys, values = torch.randn(batch, kv_heads, length, 16), torch.randn(batch, kv_heads, length, 16)
    visible = tree_visibility(parents).expand(batch, width, width)
    mask = region_attention_mask(torch.tensor(prefix), visible, length)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, scale=0.25, enable_gqa=True
    ).transpose(1, 2)
    got = attention(q, keys, values, mask, 0.25)
    assert torch.allclose(got, expected.reshape(batch, width, heads * 16), atol=2e-6)


def test_widths_padded_to_their_bucket_leave_the_real_rows_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's compiled call pads the query width to a power of two (rows that see nothing); run
    here through the uncompiled function."""
    monkeypatch.setitem(cuda_attention._compiled, "cuda", masked_attention)
    torch.manual_seed(4)
    q, keys, values = torch.randn(3, 8, 5, 16), torch.randn(3, 2, 20, 16), torch.randn(3, 2, 20, 16)
    visible = tree_visibility([-1, 0, 0, 1, 2]).expand(3, 5, 5)
    mask = region_attention_mask(torch.tensor([15, 4, 9]), visible, 20)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert torch.allclose(cuda_attention.bucketed(q, keys, values, mask, 0.25), expected, atol=2e-6)
    buckets = [cuda_attention.width_bucket(w) for w in (1, 16, 17, 128, 900, 1500, 5000)]
    assert buckets == [16, 16, 128, 128, 1024, 2048, 8192]


def test_the_causal_mask_of_a_float32_prefill_equals_sdpa_causal() -> None:
    """A float32 prefill on CUDA (no flash kernel in fp32) takes the masked path with ``causal``."""
    torch.manual_seed(3)
    q, keys, values = torch.randn(2, 8, 12, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    expected = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=0.3, enable_gqa=True)
    got = masked_attention(q, keys, values, causal(12, 12, q.device).expand(2, 1, 12, 12), 0.3)
    assert torch.allclose(got, expected, atol=2e-6)


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tiny_llama_draft: Path) -> tuple:
    return load_model(str(tiny_llama), "float32"), load_model(str(tiny_llama_draft), "float32")


@pytest.mark.parametrize(("num_candidates", "depth"), [(3, 3), (1, 4)], ids=["tree", "chain"])
def test_torch_backend_speculation_equals_plain_decoding(
    pair: tuple, num_candidates: int, depth: int
) -> None:
    target, draft = pair
    prompts = random_prompts(31, (1, 6, 23, 40))
    plain = decode(Engine(target, None, EngineConfig(max_model_len=128, adaptive=False)), prompts, GREEDY)
    config = EngineConfig(
        num_candidates, depth, max_batch=4, max_model_len=128, adaptive=False, backend="torch"
    )
    engine = Engine(target, ModelDrafter(draft), config)
    assert decode(engine, prompts, GREEDY) == plain
    assert engine.totals.accepted_tokens > 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_speculation_through_flex_attention_equals_plain_decoding(
    pair: tuple, flex_on_cpu: None, graphs: bool
) -> None:
    """Trees, ragged batches and (with graphs) padded static shapes through FlexAttention, token
    for token as plain decoding on the CPU backend."""
    target, draft = pair
    prompts = random_prompts(33, (2, 7, 19))
    plain = decode(Engine(target, None, EngineConfig(max_model_len=96, adaptive=False)), prompts, GREEDY)
    config = EngineConfig(
        3, 3, max_batch=3, max_model_len=96, adaptive=False, backend="torch", cuda_graphs=graphs
    )
    engine = Engine(target, ModelDrafter(draft), config)
    assert decode(engine, prompts, GREEDY) == plain
    assert engine.totals.accepted_tokens > 0


@pytest.mark.parametrize(("num_candidates", "depth"), [(3, 3), (1, 4)], ids=["tree", "chain"])
def test_static_graph_forward_equals_the_eager_forward(pair: tuple, num_candidates: int, depth: int) -> None:
    """Bucketed static shapes (what CUDA graphs capture), run uncaptured on the CPU: batches that
    grow and shrink, padded rows and nodes, attention over the whole capacity."""
    target, draft = pair
    prompts = random_prompts(32, (3, 9, 17, 30, 2))
    params = [GREEDY, SamplingParams(max_tokens=9, ignore_eos=True)]
    outputs = []
    for graphs in (False, True):
        config = EngineConfig(
            num_candidates,
            depth,
            max_batch=3,
            max_model_len=96,
            adaptive=False,
            backend="torch",
            cuda_graphs=graphs,
        )
        engine = Engine(target, ModelDrafter(draft), config)
        seqs = [engine.add_request(f"r{i}", p, params[i % 2]) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        outputs.append([s.output_ids for s in seqs])
        if graphs:
            assert engine.target.static.graphs and engine.drafter.runner.static.graphs
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "draft"])
def test_graph_padding_leaves_a_kept_prefix_intact(pair: tuple, drafted: bool) -> None:
    """A finishes and its prefix is kept in a free slot; three sequences decode on, padded to a
    graph bucket of four, so a padding row runs beside them; then E resends A's prompt and more.
    E reuses A's kept prefix, and decodes what it decodes eagerly: padding rows write only to
    the scratch slot, never into a free slot that keeps a prefix."""
    target, draft = pair
    first, *others = random_prompts(35, (20, 6, 9, 11))
    resent = [*first, *random_prompts(36, (5,))[0]]
    outputs, reused = [], []
    for graphs in (False, True):
        config = EngineConfig(
            1, 3, max_batch=4, max_model_len=96, adaptive=False, backend="torch", cuda_graphs=graphs
        )
        engine = Engine(target, ModelDrafter(draft) if drafted else None, config)
        a = engine.add_request("a", first, SamplingParams(max_tokens=2, ignore_eos=True))
        for i, prompt in enumerate(others):
            engine.add_request(f"o{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        while not a.finished:
            engine.step()
        for _ in range(4):
            engine.step()
        e = engine.add_request("e", resent, GREEDY)
        while engine.has_unfinished():
            engine.step()
        outputs.append(e.output_ids)
        reused.append(e.cached_tokens)
    assert reused[0] == reused[1] >= 16
    assert outputs[0] == outputs[1]


def test_cuda_graphs_are_refused_on_the_cpu_backend(pair: tuple) -> None:
    with pytest.raises(ValueError, match="torch backend"):
        Engine(pair[0], None, EngineConfig(max_model_len=64, adaptive=False, backend="cpu", cuda_graphs=True))


def test_static_graphs_attend_over_a_bucketed_span(pair: tuple) -> None:
    """Graphs are keyed by the attended span (powers of two from 256), not the whole capacity:
    sequences crossing 256 tokens switch graphs and decode what the eager forward decodes."""
    target, draft = pair
    prompts = random_prompts(33, (240, 20))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = []
    for graphs in (False, True):
        config = EngineConfig(
            2, 2, max_batch=2, max_model_len=512, adaptive=False, backend="torch", cuda_graphs=graphs
        )
        engine = Engine(target, ModelDrafter(draft), config)
        outputs.append(decode(engine, prompts, params))
    spans = {key[2] for key in engine.target.static.graphs}
    assert {256, 512} <= spans and max(spans) < engine.target.capacity
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_torch_backend_plain_decoding_equals_the_cpu_backend(
    request: pytest.FixtureRequest, family: str
) -> None:
    """Plain decode steps and prefills from position 0 attend without a mask on the torch
    backend (grouped-query decode folded into one call); they decode what the CPU backend does."""
    target = load_model(str(request.getfixturevalue(f"tiny_{family}")), "float32")
    prompts = random_prompts(34, (1, 7, 30))
    outputs = [
        decode(Engine(target, None, EngineConfig(max_model_len=128, adaptive=False, backend=b)), [p], GREEDY)
        for b in ("cpu", "torch")
        for p in prompts
    ]
    assert outputs[: len(prompts)] == outputs[len(prompts) :]
