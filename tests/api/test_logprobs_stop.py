"""Log-probabilities when a stop string ends the text: they cover exactly the tokens of the
returned text, whether the cut falls between tokens or inside one, streamed and not."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.api.conftest import MODEL, LiveServer

PROMPT = "w3 w9 w27 w14"
CHAT = [{"role": "user", "content": "w8 w41 w2"}]
FIELDS: dict[str, Any] = dict(temperature=0, max_tokens=16, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def cuts(tokens: list[str]) -> list[tuple[str, str, int]]:
    """Stop strings over the word-level text ``" ".join(tokens)``, each found there first where
    it is meant to cut: (stop, the text left, how many tokens that text holds). Between tokens
    (the space before a token starts the stop string) and inside a two-digit token (its digits)."""
    text = " ".join(tokens)
    out = []
    for k in range(2, len(tokens)):
        start = len(" ".join(tokens[:k])) + 1  # where token k's text begins
        between, inside = " " + tokens[k], tokens[k][1:]
        if len(tokens[k]) == 3 and text.find(between) == start - 1 and text.find(inside) == start + 1:
            out.append((between, text[: start - 1], k))
            out.append((inside, text[: start + 1], k + 1))
    assert out, f"no usable stop string in {text!r}"
    return out[:2]


def completion_logprobs(oai: openai.OpenAI, stream: bool, **fields: Any) -> tuple[str, dict[str, list]]:
    """The text and the logprobs lists of one completion, joined over a stream's chunks."""
    got = oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, stream=stream, **FIELDS, **fields)
    chunks = [c.choices[0] for c in got if c.choices] if stream else [got.choices[0]]
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for choice in chunks:
        for key in joined:
            joined[key] += getattr(choice.logprobs, key) if choice.logprobs else []
    return "".join(c.text for c in chunks), joined


def chat_logprobs(oai: openai.OpenAI, stream: bool, **fields: Any) -> tuple[str, list]:
    messages: Any = CHAT
    got = oai.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, top_logprobs=2, stream=stream, **FIELDS, **fields
    )
    if not stream:
        return got.choices[0].message.content, got.choices[0].logprobs.content
    chunks = [c.choices[0] for c in got if c.choices]
    content = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    return "".join(c.delta.content or "" for c in chunks), content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_end_with_the_text_a_stop_string_cut(oai: openai.OpenAI, stream: bool) -> None:
    _, full = completion_logprobs(oai, False)
    for stop, text, count in cuts(full["tokens"]):
        got_text, got = completion_logprobs(oai, stream, stop=stop)
        assert got_text == text, stop
        assert got["tokens"] == full["tokens"][:count], stop
        assert got["token_logprobs"] == pytest.approx(full["token_logprobs"][:count], abs=1e-6)
        assert got["top_logprobs"] == [pytest.approx(t, abs=1e-6) for t in full["top_logprobs"][:count]]
        assert got["text_offset"] == full["text_offset"][:count]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_end_with_the_text_a_stop_string_cut(oai: openai.OpenAI, stream: bool) -> None:
    _, full = chat_logprobs(oai, False)
    for stop, text, count in cuts([e.token for e in full]):
        got_text, got = chat_logprobs(oai, stream, stop=stop)
        assert got_text == text, stop
        assert [e.token for e in got] == [e.token for e in full[:count]], stop
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in full[:count]], abs=1e-6)
