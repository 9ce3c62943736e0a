"""OpenAI's predicted outputs over HTTP, with the ``openai`` client against a real server: the
reply is the one without a prediction, and usage reports the prediction tokens accepted and
rejected; a prediction longer than the context is a 400."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.api.conftest import MODEL, LiveServer

CHAT = [{"role": "user", "content": "w5 w6 w7 w8 w9"}]


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(oai: openai.OpenAI, **fields: Any) -> Any:
    return oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}, **fields
    )


def test_a_right_prediction_is_accepted_and_changes_nothing(oai: openai.OpenAI) -> None:
    plain = chat(oai)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    predicted = chat(oai, prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    stats = predicted.model_extra["multiguess"]
    # The prediction is drafted; where the reply's own text holds a copy worth more (it repeats
    # itself here), that copy is drafted instead (engine/sources.py): together they are accepted.
    assert stats["prediction_steps"] >= 1 and details.rejected_prediction_tokens >= 0
    assert details.accepted_prediction_tokens + stats["copy_accepted_tokens"] >= 16
    assert stats["prediction_accepted_tokens"] == details.accepted_prediction_tokens
    assert (
        stats["prediction_draft_tokens"]
        == details.accepted_prediction_tokens + details.rejected_prediction_tokens
    )
    parts = chat(oai, prediction={"type": "content", "content": [{"type": "text", "text": text}]})
    assert parts.choices[0].message.content == text


def test_a_wrong_prediction_costs_rejections_not_the_reply(oai: openai.OpenAI) -> None:
    text = chat(oai).choices[0].message.content
    wrong = " ".join(f"w{i % 60}" for i in range(7, 400, 7))
    predicted = chat(oai, prediction={"type": "content", "content": wrong}, logprobs=True, top_logprobs=2)
    assert predicted.choices[0].message.content == text
    assert predicted.choices[0].logprobs.content[0].top_logprobs


def test_streamed_and_completion_predictions_report_usage(oai: openai.OpenAI, server: LiveServer) -> None:
    text = chat(oai).choices[0].message.content
    stream = chat(
        oai,
        prediction={"type": "content", "content": text},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    copied = chunks[-1].model_extra["multiguess"]["copy_accepted_tokens"]
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens + copied >= 16
    with server.client() as client:
        body = {"prompt": "w1 w2 w3", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        reply = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        predicted = client.post(
            "/v1/completions", json={**body, "prediction": {"type": "content", "content": reply}}
        )
        assert predicted.status_code == 200
        assert predicted.json()["choices"][0]["text"] == reply
        accepted = predicted.json()["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
        assert accepted + predicted.json()["multiguess"]["copy_accepted_tokens"] >= 6


def test_a_prediction_longer_than_the_context_is_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="longer than the context length"):
        chat(oai, prediction={"type": "content", "content": "w1 " * 300})
