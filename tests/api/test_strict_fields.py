"""Field types are strict, as JSON spells them, against a real server: a boolean is not an
integer, a string is not a number, and a ``logit_bias`` key is a token id in canonical decimal.
Each refusal is a 400 whose message and ``param`` name the field."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import LiveServer

CHAT = [{"role": "user", "content": "w5 w6"}]
WRONG = [
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"05": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"+5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"\u0665": 1}}, "logit_bias"),  # Arabic-Indic 5
    ("/v1/completions", {"prompt": "w1", "logit_bias": {" 5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"5 ": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "w1", "logit_bias": {"5": "1"}}, "logit_bias"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, True]]}, "prompt"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "seed": "1"}, "seed"),
    ("/v1/completions", {"prompt": "w1", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "w1", "n": True}, "n"),
    ("/v1/completions", {"prompt": "w1", "stream": "true"}, "stream"),
    ("/v1/completions", {"prompt": "w1", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "w1", "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": True}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": 1}}, "stream_options"),
    ("/generate", {"prompt": "w1", "max_tokens": True}, "max_tokens"),
    ("/generate", {"prompt": "w1", "chat": "yes"}, "chat"),
    ("/generate", {"prompt": 5}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "field"), WRONG, ids=[f"{p}-{f}-{b[f]!r}" for p, b, f in WRONG])
def test_a_value_of_the_wrong_json_type_is_a_400_naming_the_field(
    server: LiveServer, path: str, body: dict[str, Any], field: str
) -> None:
    with server.client() as client:
        resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"].startswith(field) and error["param"].startswith(field), error


def test_canonical_values_are_taken(server: LiveServer) -> None:
    """Integers where floats go, token ids 0 and above, booleans as booleans."""
    body = {
        "prompt": [5, 6],
        "max_tokens": 3,
        "temperature": 0,
        "seed": 1,
        "ignore_eos": True,
        "logit_bias": {"0": -100, "7": 100, "10": 0.5},
    }
    with server.client() as client:
        resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
