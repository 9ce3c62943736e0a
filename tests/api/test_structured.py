"""Structured output and forced tool calls through a real server and the ``openai`` client.

The tiny text model writes garbage, so output that parses, validates, matches or is one of the
choices proves the grammar did the work; and it equals the offline API's plain constrained
decoding, so speculation changed nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from multiguess import LLM, SamplingParams
from multiguess.engine.config import EngineConfig
from multiguess.params import StructuredOutputsParams

from tests.api.conftest import MODEL, LiveServer, tiny_loader
from tests.tiny_models import build_text_tokenizer

CHAT = [{"role": "user", "content": "Describe a person."}]
PROMPT = "A person: "
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
REGEX = r"[A-Z][a-z]{1,6} [0-9]{2}"
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def text_server(
    start_server: Callable[..., LiveServer], tiny_text_llama: Path, tiny_text_llama_draft: Path
) -> LiveServer:
    config = EngineConfig(
        num_candidates=3, depth=4, max_nodes=16, max_batch=8, max_model_len=512, adaptive=False
    )
    return start_server(tiny_loader(tiny_text_llama, tiny_text_llama_draft, config), request_timeout=60)


@pytest.fixture(scope="module")
def oai(text_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{text_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain(tiny_text_llama: Path) -> LLM:
    return LLM(str(tiny_text_llama), None, dtype="float32", max_model_len=512)


def chat(oai: openai.OpenAI, **fields: Any) -> Any:
    extra = {k: fields.pop(k) for k in list(fields) if k.startswith(("guided_", "structured_", "ignore_"))}
    fields.setdefault("max_tokens", 200)
    fields.setdefault("temperature", 0)
    return oai.chat.completions.create(model=MODEL, messages=CHAT, extra_body=extra, **fields)  # type: ignore[arg-type]


def complete(oai: openai.OpenAI, **fields: Any) -> Any:
    extra = {k: fields.pop(k) for k in list(fields) if k.startswith(("guided_", "structured_", "response_"))}
    fields.setdefault("max_tokens", 200)
    fields.setdefault("temperature", 0)
    return oai.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **fields)


def offline_chat(plain: LLM, spec: StructuredOutputsParams, max_tokens: int = 200, **fields: Any) -> str:
    """What the offline API, plain decoding, writes for ``CHAT`` under ``spec`` (greedy)."""
    text = plain.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = plain.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **fields)
    return plain.generate([ids], params)[0].outputs[0].text


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_output_validates_and_equals_plain_constrained_decoding(
    oai: openai.OpenAI, plain: LLM
) -> None:
    resp = chat(oai, response_format=json_schema_format(SCHEMA))
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert resp.choices[0].finish_reason == "stop"
    assert text == offline_chat(plain, StructuredOutputsParams(json=SCHEMA))
    assert resp.model_extra["multiguess"]["draft_tokens"] > 0
    free = chat(oai).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)  # the model alone writes no JSON: the grammar did


def test_json_object_output_parses(oai: openai.OpenAI, plain: LLM) -> None:
    """Any JSON object: the garbage model would write one endless string, so a bias toward the
    characters that close strings and objects (applied before the grammar) lets it finish; only
    the grammar makes what it writes JSON."""
    closers = build_text_tokenizer().convert_tokens_to_ids(['"', "}", '"}', ":", ",", "]"])
    bias = {str(t): 4 for t in closers}
    fmt = {"type": "json_object"}
    for endpoint in (chat, complete):
        choice = endpoint(oai, response_format=fmt, logit_bias=bias, max_tokens=400).choices[0]
        text = choice.message.content if endpoint is chat else choice.text
        assert choice.finish_reason == "stop", text
        assert isinstance(json.loads(text), dict) and len(text) > 20
    got = chat(oai, response_format=fmt, logit_bias=bias, max_tokens=400).choices[0].message.content
    params = {"logit_bias": {int(t): b for t, b in bias.items()}}
    assert got == offline_chat(plain, StructuredOutputsParams(json_object=True), 400, **params)
    free = chat(oai, logit_bias=bias, max_tokens=400).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)


def test_sampled_structured_output_validates(oai: openai.OpenAI) -> None:
    resp = chat(oai, response_format=json_schema_format(SCHEMA), temperature=1.0, n=3, seed=7)
    texts = [c.message.content for c in resp.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1


def test_guided_choice_and_regex(oai: openai.OpenAI) -> None:
    for endpoint in (chat, complete):
        for fields in ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}):
            resp = endpoint(oai, **fields)
            choice = resp.choices[0]
            assert (choice.message.content if endpoint is chat else choice.text) in CHOICES
        for fields in ({"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}):
            choice = endpoint(oai, temperature=0.9, seed=3, **fields).choices[0]
            assert re.fullmatch(REGEX, choice.message.content if endpoint is chat else choice.text)
    schema_text = json.dumps(SCHEMA)
    jsonschema.validate(json.loads(complete(oai, guided_json=schema_text).choices[0].text), SCHEMA)


def test_structured_output_streams(oai: openai.OpenAI) -> None:
    whole = chat(oai, response_format=json_schema_format(SCHEMA)).choices[0].message.content
    stream = chat(oai, response_format=json_schema_format(SCHEMA), stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    streamed = complete(oai, guided_choice=CHOICES, stream=True)
    assert "".join(c.choices[0].text for c in streamed) in CHOICES


def test_max_tokens_cuts_structured_output_with_length(oai: openai.OpenAI) -> None:
    resp = chat(oai, response_format=json_schema_format(SCHEMA), max_tokens=4)
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content.startswith("{")


def check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    ("tools", "tool_choice"),
    [
        ([CLOCK, WEATHER], {"type": "function", "function": {"name": "get_weather"}}),
        ([WEATHER], "required"),
    ],
    ids=["named", "required"],
)
def test_a_forced_tool_call_returns_tool_calls_with_valid_arguments(
    oai: openai.OpenAI, tools: list[dict[str, Any]], tool_choice: Any
) -> None:
    resp = chat(oai, tools=tools, tool_choice=tool_choice)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    stream = list(chat(oai, tools=tools, tool_choice=tool_choice, stream=True))
    deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == choice.message.tool_calls[0].function.arguments
    assert stream[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_without_parameters_is_called_with_none(oai: openai.OpenAI) -> None:
    choice = chat(oai, tools=[CLOCK], tool_choice="required").choices[0]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {}


def test_tool_choice_none_answers_in_text_and_history_reaches_the_template(oai: openai.OpenAI) -> None:
    resp = chat(oai, tools=[WEATHER], tool_choice="none", max_tokens=6)
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content is not None
    called = chat(oai, tools=[WEATHER], tool_choice="required").choices[0].message.tool_calls[0]
    history = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [called.model_dump()]},
        {"role": "tool", "tool_call_id": called.id, "content": "sunny"},
    ]
    follow = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=4)  # type: ignore[arg-type]
    assert follow.choices[0].message.content is not None


REFUSED = [
    ({"response_format": json_schema_format({"type": "frob"})}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nope("}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": [WEATHER]}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER, CLOCK], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
]


@pytest.mark.parametrize(("fields", "name"), REFUSED, ids=[f"{n}-{i}" for i, (_, n) in enumerate(REFUSED)])
def test_bad_or_unsupported_structure_is_a_400_naming_the_field(
    oai: openai.OpenAI, fields: dict[str, Any], name: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(oai, **fields)
    assert caught.value.status_code == 400
    assert name in caught.value.message


RECURSIVE_TOOL = {"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}}
# Grammars no output can follow, each refused before admission with why (real llguidance).
UNFOLLOWABLE = [
    ({"guided_regex": "a{1000}{1000}"}, "guided_regex", "too complex"),
    ({"guided_regex": r"[^\s\S]"}, "guided_regex", "accepts no string"),
    ({"guided_grammar": 'start: start "a"'}, "guided_grammar", "recurses without end"),
    ({"guided_choice": [f"choice{i}" for i in range(10_000)]}, "guided_choice", "at most 1000 choices"),
    ({"response_format": json_schema_format({"$ref": "#"})}, "response_format", "accepts no string"),
    ({"tools": [RECURSIVE_TOOL], "tool_choice": "required"}, "tool_choice", "accepts no string"),
    ({"guided_regex": "a" * 100_001}, "guided_regex", "at most 100000"),
]
# Passes the check (its first token is fine) but the parser's row limit is met once "!" starts
# the 2,500-way alternation: the matcher fails within four tokens of any output.
MIDWAY = 'start: /[a-z]{1,3}/ "!" c\nc: ' + " | ".join(f'"v{i}"' for i in range(2500))


@pytest.mark.parametrize(
    ("fields", "name", "why"), UNFOLLOWABLE, ids=[f"{n}-{i}" for i, (_, n, _) in enumerate(UNFOLLOWABLE)]
)
def test_a_grammar_no_output_can_follow_is_a_400_before_admission(
    oai: openai.OpenAI, text_server: LiveServer, fields: dict[str, Any], name: str, why: str
) -> None:
    """Streamed or not, through either endpoint: a 400 naming the field and why, never a 200
    whose output breaks the grammar."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(oai, stream=stream, **fields)
        assert caught.value.status_code == 400
        assert name in caught.value.message and why in caught.value.message
    if name.startswith("guided_"):
        with pytest.raises(openai.BadRequestError, match=why):
            complete(oai, **fields)
        with text_server.client() as client:
            resp = client.post("/generate", json={"prompt": PROMPT, "max_tokens": 8, **fields})
        assert resp.status_code == 400 and why in resp.json()["error"]["message"]
    assert text_server.scheduler.engine.has_unfinished() is False


def test_a_grammar_failing_midway_is_a_422_never_a_stop(oai: openai.OpenAI, text_server: LiveServer) -> None:
    """The matcher fails during generation: the whole response is a 422 (code grammar_failed)
    from either endpoint and /generate, with speculation on, and the server serves on."""
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        chat(oai, guided_grammar=MIDWAY)
    assert caught.value.code == "grammar_failed" and "too complex" in caught.value.message
    with pytest.raises(openai.UnprocessableEntityError, match="grammar"):
        complete(oai, guided_grammar=MIDWAY, n=2, temperature=0.8, seed=1)
    with text_server.client() as client:
        resp = client.post("/generate", json={"prompt": PROMPT, "max_tokens": 16, "guided_grammar": MIDWAY})
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "grammar_failed"
    assert chat(oai, guided_choice=CHOICES).choices[0].message.content in CHOICES


def test_a_grammar_failing_midway_in_a_stream_ends_it_with_an_error_event(
    oai: openai.OpenAI, text_server: LiveServer
) -> None:
    """After streaming started, the failure is an error event: no finish_reason stop, no [DONE]."""
    with pytest.raises(openai.APIError, match="grammar"):
        list(chat(oai, guided_grammar=MIDWAY, stream=True))
    body = {"prompt": PROMPT, "max_tokens": 16, "stream": True, "guided_grammar": MIDWAY}
    with text_server.client() as client:
        frames = [
            json.loads(line[6:])
            for line in client.post("/v1/completions", json=body).text.splitlines()
            if line.startswith("data: {")
        ]
    assert frames[-1]["error"]["code"] == "grammar_failed"
    assert all(c["finish_reason"] is None for f in frames[:-1] for c in f["choices"])
    assert re.fullmatch("[a-z]{0,3}", "".join(c["text"] for f in frames[:-1] for c in f["choices"]))
