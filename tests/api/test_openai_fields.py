"""Every documented request field, sent with the ``openai`` client to a real server: each has
its effect, or the request is a 400 that names the field (no field is ignored silently)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from multiguess import LLM, SamplingParams

from tests.api.conftest import MODEL, LiveServer

PROMPT = "w1 w2 w3 w4"
CHAT = [{"role": "user", "content": "w5 w6 w7"}]
EOS = 2


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama: Path, tiny_llama_draft: Path) -> LLM:
    return LLM(str(tiny_llama), str(tiny_llama_draft), dtype="float32", max_model_len=256)


def complete(oai: openai.OpenAI, **fields: Any) -> Any:
    extra = {k: fields.pop(k) for k in list(fields) if k in EXTENSIONS}
    fields.setdefault("max_tokens", 8)
    return oai.completions.create(
        model=MODEL, prompt=fields.pop("prompt", PROMPT), extra_body=extra, **fields
    )


def chat(oai: openai.OpenAI, **fields: Any) -> Any:
    extra = {k: fields.pop(k) for k in list(fields) if k in EXTENSIONS}
    fields.setdefault("max_tokens", 8)
    return oai.chat.completions.create(model=MODEL, messages=CHAT, extra_body=extra, **fields)  # type: ignore[arg-type]


EXTENSIONS = {
    "top_k",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "num_candidates",
    "depth",
    "unknown_field",
    "guided_json",
}


def test_completion_logprobs_are_the_same_with_and_without_speculation(oai: openai.OpenAI) -> None:
    spec = complete(oai, temperature=0, logprobs=3, max_tokens=12, ignore_eos=True)
    plain = complete(oai, temperature=0, logprobs=3, max_tokens=12, ignore_eos=True, depth=0)
    assert spec.model_extra["multiguess"]["accepted_tokens"] > 0
    a, b = spec.choices[0].logprobs, plain.choices[0].logprobs
    assert spec.choices[0].text == plain.choices[0].text
    assert a.tokens == b.tokens and len(a.tokens) == spec.usage.completion_tokens == 12
    assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
    assert [sorted(t) for t in a.top_logprobs] == [sorted(t) for t in b.top_logprobs]
    assert all(len(t) == 3 for t in a.top_logprobs)
    assert a.text_offset == [sum(len(t) for t in a.tokens[:i]) for i in range(len(a.tokens))]
    assert all(lp <= 0 for lp in a.token_logprobs)


def test_completion_logprobs_match_the_offline_api(oai: openai.OpenAI, offline: LLM) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, logprobs=2, ignore_eos=True)
    want = offline.generate(PROMPT, params)[0].outputs[0]
    got = complete(oai, temperature=0.8, top_p=0.9, seed=5, logprobs=2, max_tokens=10, ignore_eos=True)
    assert got.choices[0].text == want.text
    assert want.logprobs is not None
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(
        [r.logprob for r in want.logprobs], abs=1e-5
    )


def test_chat_logprobs_streamed_and_whole_agree(oai: openai.OpenAI) -> None:
    whole = chat(oai, temperature=0, logprobs=True, top_logprobs=2, max_tokens=10, ignore_eos=True)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 10
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-9 for c in content)  # greedy takes the best
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        max_tokens=10,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content
    ]
    assert [c.token for c in streamed] == [c.token for c in content]
    # The second request may copy the first one's reply (recent outputs): its trees differ,
    # and fp32 rows verified in different trees round apart in the last bits.
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = chat(oai, temperature=0, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_streamed_completion_logprobs_cover_every_token(oai: openai.OpenAI) -> None:
    stream = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=9,
        temperature=0,
        logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens, offsets = [], []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
    assert len(tokens) == 9
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(9)]


def test_penalties_and_bias_change_the_output(oai: openai.OpenAI, offline: LLM) -> None:
    base = complete(oai, temperature=0, max_tokens=16, ignore_eos=True).choices[0].text
    for fields in (
        dict(presence_penalty=1.5),
        dict(frequency_penalty=1.5),
        dict(repetition_penalty=1.8),
    ):
        got = complete(oai, temperature=0, max_tokens=16, ignore_eos=True, **fields).choices[0].text
        params = SamplingParams(max_tokens=16, ignore_eos=True, **fields)  # type: ignore[arg-type]
        assert got == offline.generate(PROMPT, params)[0].text, fields
    assert any(
        complete(oai, temperature=0, max_tokens=16, ignore_eos=True, **{k: 1.8}).choices[0].text != base
        for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    )
    word = offline.tokenizer.convert_tokens_to_ids("w9")
    biased = complete(oai, temperature=0, max_tokens=5, ignore_eos=True, logit_bias={str(word): 100})
    assert biased.choices[0].text.split() == ["w9"] * 5


def test_min_tokens_defers_the_end(oai: openai.OpenAI) -> None:
    eager = complete(oai, temperature=0, max_tokens=10, logit_bias={str(EOS): 100})
    assert eager.usage.completion_tokens == 1 and eager.choices[0].finish_reason == "stop"
    held = complete(oai, temperature=0, max_tokens=10, logit_bias={str(EOS): 100}, min_tokens=4)
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"


def test_truncation_and_stop_tokens_have_their_effect(oai: openai.OpenAI, offline: LLM) -> None:
    greedy = complete(oai, temperature=0, max_tokens=10, ignore_eos=True).choices[0].text
    # A sample from the best token alone, or from a nucleus that small, is the greedy output.
    for truncation in (dict(top_k=1), dict(top_p=1e-6)):
        got = complete(oai, temperature=1.5, max_tokens=10, ignore_eos=True, **truncation)
        assert got.choices[0].text == greedy, truncation
    sampled = [complete(oai, temperature=1.5, max_tokens=10, ignore_eos=True) for _ in range(3)]
    assert {s.choices[0].text for s in sampled} != {greedy}
    third = offline.tokenizer.convert_tokens_to_ids(greedy.split()[2])
    stopped = complete(oai, temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[third])
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[third])
    assert stopped.choices[0].text == offline.generate(PROMPT, params)[0].text
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 3


def test_max_completion_tokens_wins_and_the_tree_may_shrink(oai: openai.OpenAI) -> None:
    resp = chat(oai, temperature=0, max_tokens=8, max_completion_tokens=3, ignore_eos=True)
    assert resp.usage.completion_tokens == 3
    base = complete(oai, temperature=0, max_tokens=12, ignore_eos=True)
    chain = complete(oai, temperature=0, max_tokens=12, ignore_eos=True, num_candidates=1, depth=2)
    stats = chain.model_extra["multiguess"]
    assert chain.choices[0].text == base.choices[0].text
    assert 0 < stats["draft_tokens"] <= 2 * stats["verify_steps"]  # one chain of two at most


def test_another_models_name_is_a_404(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        oai.completions.create(model="other", prompt=PROMPT, max_tokens=2)
    assert "model" in caught.value.message


def test_echo_prepends_the_prompt(oai: openai.OpenAI) -> None:
    plain = complete(oai, temperature=0, max_tokens=4)
    echoed = complete(oai, temperature=0, max_tokens=4, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    stream = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_too(oai: openai.OpenAI, offline: LLM) -> None:
    """The prompt's tokens lead: the first with null log-probability and alternatives, the rest
    with the target's own (prompt_logprobs); then the completion's, as without echo; streamed
    the same."""
    plain = complete(oai, temperature=0, max_tokens=5, logprobs=2, ignore_eos=True).choices[0]
    echoed = complete(oai, temperature=0, max_tokens=5, logprobs=2, ignore_eos=True, echo=True).choices[0]
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    assert want is not None and len(want) == len(ids)
    lp, count = echoed.logprobs, len(ids)
    assert echoed.text == PROMPT + plain.text
    assert lp.tokens == [offline.tokenizer.decode([t]) for t in ids] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:count] == pytest.approx([r.logprob for r in want[1:]], abs=1e-5)  # type: ignore[union-attr]
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[count:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        echo=True,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == echoed.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset
    streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-9)


def test_best_of_returns_the_most_likely_of_its_samples(oai: openai.OpenAI) -> None:
    fields = dict(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    every = complete(oai, n=4, logprobs=0, **fields)
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices]
    assert len({c.text for c in every.choices}) > 1
    best = complete(oai, best_of=4, **fields)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == every.choices[mean.index(max(mean))].text
    two = complete(oai, n=2, best_of=4, **fields)
    order = sorted(range(4), key=lambda i: -mean[i])[:2]
    assert [c.text for c in two.choices] == [every.choices[i].text for i in order]
    assert [c.index for c in two.choices] == [0, 1]


def test_fields_without_a_generation_effect_are_accepted(oai: openai.OpenAI) -> None:
    """Identifiers and hints OpenAI defines with no effect on the text are taken as such."""
    base = chat(oai, temperature=0, max_tokens=6).choices[0].message.content
    resp = chat(
        oai,
        temperature=0,
        max_tokens=6,
        user="someone",
        metadata={"team": "a"},
        store=False,
        service_tier="auto",
        modalities=["text"],
        parallel_tool_calls=True,
        prompt_cache_key="k",
        safety_identifier="s",
        response_format={"type": "text"},
        tool_choice="none",
    )
    assert resp.choices[0].message.content == base
    assert complete(oai, temperature=0, max_tokens=4, user="u", suffix="").choices[0].text


REFUSED = [
    ("chat", dict(response_format={"type": "json_schema"}), "response_format"),
    (
        "chat",
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        "tool_choice",
    ),
    ("chat", dict(tool_choice="required"), "tool_choice"),
    ("chat", dict(store=True), "store"),
    ("chat", dict(modalities=["text", "audio"]), "modalities"),
    ("chat", dict(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("chat", dict(prediction={"type": "image", "content": "w1"}), "prediction"),
    ("chat", dict(reasoning_effort="low"), "reasoning_effort"),
    ("chat", dict(top_logprobs=2), "top_logprobs"),
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(unknown_field=1), "unknown_field"),
    ("chat", dict(guided_json={"type": "object"}), "guided_json"),  # a word-level tokenizer
    ("completion", dict(suffix="w9"), "suffix"),
    ("completion", dict(best_of=1, n=2), "best_of"),
    ("completion", dict(best_of=3, stream=True), "best_of"),
    ("completion", dict(logprobs=21), "logprobs"),
    ("completion", dict(logit_bias={"w1": 1}), "logit_bias"),
    ("completion", dict(logit_bias={"5": 101}), "logit_bias"),
    ("completion", dict(logit_bias={"100000": 1}), "logit_bias"),
    ("completion", dict(presence_penalty=2.5), "presence_penalty"),
    ("completion", dict(frequency_penalty=-3), "frequency_penalty"),
    ("completion", dict(repetition_penalty=0), "repetition_penalty"),
    ("completion", dict(min_tokens=9), "min_tokens"),
    ("completion", dict(unknown_field=1), "unknown_field"),
    ("completion", dict(num_candidates=4), "num_candidates"),
    ("completion", dict(depth=5), "depth"),
    ("completion", dict(temperature=-1), "temperature"),
    ("completion", dict(top_p=0), "top_p"),
    ("completion", dict(top_k=-2), "top_k"),
    ("completion", dict(seed=-1), "seed"),
    ("completion", dict(n=0), "n"),
    ("completion", dict(max_tokens=0), "max_tokens"),
    ("completion", dict(stop=[""]), "stop"),
    ("completion", dict(stop_token_ids=[100000]), "stop_token_ids"),
]


@pytest.mark.parametrize(("endpoint", "fields", "name"), REFUSED, ids=[f"{e}-{n}" for e, _, n in REFUSED])
def test_unsupported_or_invalid_fields_are_a_400_naming_them(
    oai: openai.OpenAI, endpoint: str, fields: dict, name: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        (chat if endpoint == "chat" else complete)(oai, **fields)
    assert caught.value.status_code == 400
    assert name in caught.value.message
