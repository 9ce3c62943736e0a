"""Bad input gets a clear 4xx in OpenAI's error shape: never a 500, never a hang."""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import MODEL, LiveServer

LONG_PROMPT = " ".join(["w1"] * 300)  # the tiny server's context is 256 tokens
CHAT = [{"role": "user", "content": "w1"}]

CASES = [
    ("/v1/completions", b'{"prompt": "w1", ', 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, ""),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": {"text": "w1"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 10**9}, 400, "context length"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "context length"),
    ("/v1/completions", {"prompt": [5, 6, 10**6]}, 400, "token ids"),
    ("/v1/completions", {"prompt": "w1", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "w1", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "w1", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "w1", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "w1", "n": 0}, 400, "n must"),
    ("/v1/completions", {"prompt": "w1", "n": 10**12}, 400, "samples"),
    ("/v1/completions", {"prompt": "w1", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "w1", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "w1", "num_candidates": 99}, 400, "num_candidates"),
    ("/v1/completions", {"prompt": "w1", "depth": -1}, 400, "depth"),
    ("/v1/completions", {"prompt": [5, -334844429777], "echo": True}, 400, "token ids"),
    ("/v1/completions", {"prompt": [[5, 10**6]], "echo": True, "logprobs": 2}, 400, "token ids"),
    ("/v1/completions", {"prompt": "w1", "stream": "sometimes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "w1", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w1"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": "w1"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "does not exist"),
    ("/generate", {}, 400, "prompt"),
    ("/generate", {"prompt": 5}, 400, "prompt"),
    ("/generate", {"prompt": "w1", "temperature": "hot"}, 400, "temperature"),
    ("/v1/nothing", {}, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), CASES)
def test_bad_input_gets_a_clear_openai_error(
    server: LiveServer, path: str, body: object, status: int, words: str
) -> None:
    with server.client() as client:
        if isinstance(body, bytes):
            resp = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            resp = client.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words.lower() in error["message"].lower(), error


def test_wrong_method_is_405_in_the_same_shape(server: LiveServer) -> None:
    with server.client() as client:
        resp = client.get("/v1/completions")
    assert resp.status_code == 405
    assert resp.json()["error"]["message"]


def test_openai_client_raises_typed_errors(server: LiveServer) -> None:
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model=MODEL, prompt="w1", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.chat.completions.create(model="other", messages=CHAT)  # type: ignore[arg-type]


def test_nan_and_infinity_are_rejected(server: LiveServer) -> None:
    """Python's JSON reader accepts NaN/Infinity; they must not reach the sampler."""
    with server.client() as client:
        for literal in (b"NaN", b"Infinity"):
            body = b'{"prompt": "w1", "temperature": ' + literal + b"}"
            resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400, resp.text
