"""Log-probabilities come from the target's own processed distribution for every emitted token,
accepted drafted tokens included, so speculation does not change them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiguess import LLM, SamplingParams
from multiguess.engine.logprobs import FLOOR
from multiguess.engine.penalties import adjusted_logits
from multiguess.engine.sampling import Processing, processed_probs
from multiguess.engine.tree import TokenTree
from transformers import AutoModelForCausalLM

from tests.engine.test_lossless import random_prompts

TOP = 4


def reference_logprobs(
    model_dir: Path, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """``[len(output), V]`` log-probabilities each output token was chosen from: one forward of
    transformers over the whole text, each position adjusted and processed as plain decoding
    would see it."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    rows = []
    for i, row in enumerate(logits):
        row = adjusted_logits(row[None], TokenTree.chain([0]), params, prompt, output[:i], frozenset())[0]
        if params.greedy:
            rows.append(torch.log_softmax(row.double(), dim=-1))
        else:
            processing = Processing(params.temperature, params.top_p, params.top_k)
            rows.append(torch.log(processed_probs(row[None], [processing])[0]))
    return torch.stack(rows)


CASES = {
    "greedy": dict(temperature=0.0),
    "greedy-penalized": dict(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2),
    "sampled": dict(temperature=0.8, top_p=0.9, seed=3),
    "sampled-topk-penalized": dict(temperature=1.0, top_k=8, frequency_penalty=0.4, seed=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_are_the_targets_processed_distribution(
    tiny_llama: Path, tiny_llama_draft: Path, case: str
) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=TOP, **CASES[case])  # type: ignore[arg-type]
    spec = LLM(str(tiny_llama), str(tiny_llama_draft), 3, 4, dtype="float32", adaptive=False)
    prompts = random_prompts(11, (5, 23))
    outs = spec.generate(prompts, params)
    assert sum(o.stats["accepted_tokens"] for o in outs) > 0, "no drafted token was accepted"
    for prompt, out in zip(prompts, outs, strict=True):
        records = out.outputs[0].logprobs
        assert records is not None and [r.token for r in records] == out.token_ids
        expected = reference_logprobs(tiny_llama, prompt, out.token_ids, params)
        chosen = expected.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].clamp(min=FLOOR)
        torch.testing.assert_close(
            torch.tensor([r.logprob for r in records], dtype=torch.float64), chosen, atol=1e-4, rtol=0
        )
        for record, row in zip(records, expected, strict=True):
            assert len(record.top) == TOP
            best = row.topk(TOP)
            assert [t for t, _ in record.top][:2] == best.indices.tolist()[:2]
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in record.top], dtype=torch.float64),
                best.values.clamp(min=FLOOR),
                atol=1e-4,
                rtol=0,
            )


def test_greedy_logprobs_are_the_same_with_and_without_speculation(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=TOP)
    prompts = random_prompts(12, (3, 30))
    plain = LLM(str(tiny_llama), None, dtype="float32").generate(prompts, params)
    for shape in [(1, 4), (3, 4)]:
        spec = LLM(str(tiny_llama), str(tiny_llama_draft), *shape, dtype="float32", adaptive=False)
        for got, want in zip(spec.generate(prompts, params), plain, strict=True):
            assert got.token_ids == want.token_ids
            a, b = got.outputs[0].logprobs, want.outputs[0].logprobs
            assert a is not None and b is not None
            assert [[t for t, _ in r.top] for r in a] == [[t for t, _ in r.top] for r in b]
            torch.testing.assert_close(
                torch.tensor([r.logprob for r in a]), torch.tensor([r.logprob for r in b]), atol=1e-5, rtol=0
            )


def test_no_logprobs_unless_asked(tiny_llama: Path) -> None:
    out = LLM(str(tiny_llama), None, dtype="float32").generate([[5, 6]], SamplingParams(max_tokens=3))[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    with_lp = LLM(str(tiny_llama), None, dtype="float32").generate(
        [[5, 6]], SamplingParams(max_tokens=3, logprobs=0)
    )
    records = with_lp[0].outputs[0].logprobs
    assert records is not None and len(records) == 3 and all(r.top == () for r in records)
