"""The OpenAI-compatible endpoints against a real server, with httpx and the ``openai`` package.

Every text is checked against the offline API on the same models: the server must add no
difference of its own (prompt handling, chat template, streaming, stop strings).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from multiguess import LLM, SamplingParams

from tests.api.conftest import MODEL, LiveServer
from tests.api.helpers import metric, sse_events

PROMPT = "w1 w2 w3 w4"


@pytest.fixture(scope="module")
def offline(tiny_llama: Path, tiny_llama_draft: Path) -> LLM:
    return LLM(str(tiny_llama), str(tiny_llama_draft), dtype="float32", max_model_len=256)


def expected(offline: LLM, prompt: str | list[int], **params: object) -> tuple[str, int, str | None]:
    out = offline.generate(prompt, SamplingParams(**params))[0].outputs[0]  # type: ignore[arg-type]
    return out.text, len(out.token_ids), out.finish_reason


def chat_ids(offline: LLM, content: str) -> list[int]:
    text = offline.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return offline.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completion_matches_offline_and_reports_usage_and_stats(oai: openai.OpenAI, offline: LLM) -> None:
    text, tokens, reason = expected(offline, PROMPT, max_tokens=12, ignore_eos=True)
    resp = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].text == text
    assert resp.choices[0].finish_reason == reason == "length"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (4, tokens)
    stats = resp.model_extra["multiguess"]  # type: ignore[index]
    assert stats["verify_steps"] >= 1 and stats["draft_tokens"] > 0
    assert stats["mean_accepted_length"] == pytest.approx(
        1 + stats["accepted_tokens"] / stats["verify_steps"], abs=1e-3
    )


def test_streamed_completion_equals_the_whole_one(oai: openai.OpenAI, offline: LLM) -> None:
    text, tokens, _ = expected(offline, PROMPT, max_tokens=20, ignore_eos=True)
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == tokens


def test_stream_is_sse_ending_in_done(server: LiveServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_chat_uses_the_targets_template(oai: openai.OpenAI, offline: LLM) -> None:
    text, tokens, _ = expected(offline, chat_ids(offline, "w7 w8"), max_tokens=10, ignore_eos=True)
    messages = [{"role": "user", "content": "w7 w8"}]
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == text
    assert resp.usage is not None and resp.usage.prompt_tokens == len(chat_ids(offline, "w7 w8"))
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == tokens


def test_stop_strings_cut_the_text(oai: openai.OpenAI, offline: LLM) -> None:
    full, _, _ = expected(offline, PROMPT, max_tokens=12, ignore_eos=True)
    stop = full.split()[3]
    text, _, reason = expected(offline, PROMPT, max_tokens=12, ignore_eos=True, stop=(stop,))
    resp = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].text == text and stop not in text
    assert resp.choices[0].finish_reason == reason == "stop"


def test_sampled_choices_are_reproducible_with_a_seed(oai: openai.OpenAI) -> None:
    def sample() -> list[str]:
        resp = oai.completions.create(
            model=MODEL, prompt=[PROMPT, "w9 w9"], n=2, max_tokens=8, temperature=1.0, seed=7
        )
        assert [c.index for c in resp.choices] == [0, 1, 2, 3]
        return [c.text for c in resp.choices]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1


def test_generate_endpoint(server: LiveServer, offline: LLM) -> None:
    text, tokens, _ = expected(offline, "w5 w6", max_tokens=9)
    with server.client() as client:
        resp = client.post("/generate", json={"prompt": "w5 w6", "max_tokens": 9})
    assert resp.status_code == 200
    body = resp.json()
    assert body["result"] == text
    assert body["usage"]["completion_tokens"] == tokens
    with server.client() as client:
        chat = client.post("/generate", json={"prompt": "w7 w8", "max_tokens": 10, "chat": True}).json()
    assert chat["result"] == expected(offline, chat_ids(offline, "w7 w8"), max_tokens=10)[0]
    assert set(body["multiguess"]) >= {
        "verify_steps",
        "draft_tokens",
        "accepted_tokens",
        "mean_accepted_length",
    }


def test_models_and_health(server: LiveServer, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list()] == [MODEL]
    with server.client() as client:
        assert client.get("/health/live").json() == {"status": "alive"}
        assert client.get("/health/ready").json() == {"status": "ready"}


METRICS = [
    "multiguess_request_queue_seconds",
    "multiguess_time_to_first_token_seconds",
    "multiguess_inter_token_latency_seconds",
    "multiguess_e2e_request_seconds",
    "multiguess_requests_running",
    "multiguess_requests_waiting",
    "multiguess_prompt_tokens_total",
    "multiguess_generation_tokens_total",
    "multiguess_spec_verify_steps_total",
    "multiguess_spec_draft_tokens_total",
    "multiguess_spec_accepted_tokens_total",
    "multiguess_spec_fallback_steps_total",
    "multiguess_requests_rejected_total",
    "multiguess_batch_size",
    "multiguess_spec_tree_nodes",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
]


def test_metrics_are_exposed_and_move(server: LiveServer) -> None:
    with server.client() as client:
        text = client.get("/metrics").text
        for name in METRICS:
            assert f"\n{name}" in text, name
        moving = [
            "multiguess_prompt_tokens_total",
            "multiguess_generation_tokens_total",
            "multiguess_spec_verify_steps_total",
            "multiguess_spec_draft_tokens_total",
            "multiguess_e2e_request_seconds_count",
            "multiguess_time_to_first_token_seconds_count",
            "multiguess_request_queue_seconds_count",
            "multiguess_inter_token_latency_seconds_count",
            "multiguess_batch_size_count",
            "multiguess_spec_tree_nodes_sum",
        ]
        before = {name: metric(client, name) for name in moving}
        resp = client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        )
        usage = resp.json()["usage"]
        after = {name: metric(client, name) for name in moving}
    assert (
        after["multiguess_prompt_tokens_total"] - before["multiguess_prompt_tokens_total"]
        == usage["prompt_tokens"]
    )
    assert after["multiguess_generation_tokens_total"] - before["multiguess_generation_tokens_total"] == 10
    for name in moving:
        assert after[name] > before[name], name


def test_raw_httpx_client_sees_openai_errors(server: LiveServer) -> None:
    with server.client() as client:
        resp = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert resp.status_code == 400
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(httpx.HTTPStatusError):
        resp.raise_for_status()
