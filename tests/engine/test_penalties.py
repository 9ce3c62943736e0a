"""Penalties, bias and min_tokens: defined along each tree path, lossless under speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.engine.penalties import adjusted_logits
from multiguess.engine.tree import TokenTree
from transformers import AutoModelForCausalLM

from tests.engine.test_lossless import random_prompts
from tests.fake_device import FakeDevice

EOS = 2  # the tiny models' end-of-sequence token
PENALIZED = dict(
    presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4, logit_bias={7: 3.0, 9: -50}
)


def test_a_node_counts_its_ancestors_tokens() -> None:
    """A node's row is what a root-only tree would get with the path to it already generated."""
    vocab = 20
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 3
    #        0 (root 4)
    #      1(5)    2(5)
    #     3(6)     4(5)
    #     5(4)
    tree = TokenTree((4, 5, 5, 6, 5, 4), (-1, 0, 0, 1, 2, 3))
    params = SamplingParams(max_tokens=32, min_tokens=4, **PENALIZED)  # type: ignore[arg-type]
    prompt, output, stops = [1, 3, 9], [4, 4, 8], frozenset({EOS, 11})
    got = adjusted_logits(logits, tree, params, prompt, output, stops)
    paths = {0: [], 1: [5], 2: [5], 3: [5, 6], 4: [5, 5], 5: [5, 6, 4]}
    for node, path in paths.items():
        alone = adjusted_logits(
            logits[node : node + 1], TokenTree.chain([4]), params, prompt, output + path, stops
        )
        torch.testing.assert_close(got[node], alone[0])
    barred = [len(output) + len(path) < params.min_tokens for path in paths.values()]
    assert [bool(torch.isinf(got[n, EOS])) for n in paths] == barred
    assert torch.isinf(got[:, 11]).tolist() == barred


def test_adjustments_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0]])
    root = TokenTree.chain([3])
    bias = adjusted_logits(logits, root, SamplingParams(logit_bias={4: 1.5}), [], [], frozenset())
    assert bias.tolist() == [[2.0, -2.0, 1.0, 0.5, 1.5]]
    rep = adjusted_logits(logits, root, SamplingParams(repetition_penalty=2.0), [0], [1], frozenset())
    assert rep.tolist() == [[1.0, -4.0, 1.0, 0.5, 0.0]]  # seen in the prompt or the output
    counts = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    pen = adjusted_logits(logits, root, counts, [2], [0, 0, 3], frozenset())  # prompt tokens do not count
    assert pen.tolist() == [[2.0 - 0.5 - 0.5, -2.0, 1.0, 0.5 - 0.5 - 0.25, 0.0]]
    assert adjusted_logits(logits, root, SamplingParams(), [0], [1], frozenset()) is logits


@pytest.mark.parametrize(("num_candidates", "depth"), [(1, 4), (3, 4), (4, 2)])
def test_penalized_greedy_speculation_equals_plain_decoding(
    tiny_llama: Path, tiny_llama_draft: Path, num_candidates: int, depth: int
) -> None:
    prompts = random_prompts(31, (3, 12, 40))
    params = SamplingParams(max_tokens=24, ignore_eos=True, **PENALIZED)  # type: ignore[arg-type]
    spec = LLM(str(tiny_llama), str(tiny_llama_draft), num_candidates, depth, dtype="float32", adaptive=False)
    plain = LLM(str(tiny_llama), None, dtype="float32")
    outs = spec.generate(prompts, params)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in outs] == expected
    assert sum(o.stats["accepted_tokens"] for o in outs) > 0
    unpenalized = [
        o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    ]
    assert unpenalized != expected, "the penalties changed nothing: the test would prove nothing"
    assert all(9 not in ids for ids in expected)  # biased by -50


def test_repetition_penalty_matches_transformers(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    """transformers' own processor is the independent reference for repetition_penalty."""
    prompts = random_prompts(5, (4, 17))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    expected = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, repetition_penalty=1.5
        )
        expected.append(ids[0, len(prompt) :].tolist())
    spec = LLM(str(tiny_llama), str(tiny_llama_draft), 3, 3, dtype="float32", adaptive=False)
    outs = spec.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.5))
    assert [o.token_ids for o in outs] == expected


def test_min_tokens_holds_back_the_end(tiny_llama: Path, tiny_llama_draft: Path) -> None:
    spec = LLM(str(tiny_llama), str(tiny_llama_draft), 3, 4, dtype="float32", adaptive=False)
    eager_end = SamplingParams(max_tokens=20, logit_bias={EOS: 100})
    assert spec.generate([[5, 6, 7]], eager_end)[0].token_ids == [EOS]
    out = spec.generate([[5, 6, 7]], SamplingParams(max_tokens=20, logit_bias={EOS: 100}, min_tokens=6))[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
    assert out.outputs[0].finish_reason == "stop"


ON_DEVICE = [
    SamplingParams(max_tokens=10, logprobs=3, min_tokens=4, **{**PENALIZED, "logit_bias": {EOS: 5.0}}),  # type: ignore[arg-type]
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=2, logprobs=2, **PENALIZED),  # type: ignore[arg-type]
    SamplingParams(max_tokens=10, temperature=1.0, top_k=10, logprobs=1, min_tokens=3, **PENALIZED),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("params", ON_DEVICE, ids=["greedy", "seeded", "sampled"])
def test_adjustments_and_logprobs_stay_on_the_device(
    tiny_llama: Path, tiny_llama_draft: Path, params: SamplingParams
) -> None:
    """Penalties, bias, min_tokens, logprobs and seeded draws make their tensors on the device
    of the logits they meet (``tests/fake_device.py`` catches a host tensor meeting them)."""
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), 3, 3, dtype="float32", adaptive=False)
    prompts = random_prompts(24, (5, 13))
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    mode = FakeDevice()
    with mode:
        mode.adopt(llm)
        outs = llm.generate(prompts, params)
    assert mode.caught == []
    assert all(o.outputs[0].logprobs for o in outs)
    if params.greedy or params.seed is not None:
        assert [o.token_ids for o in outs] == expected
