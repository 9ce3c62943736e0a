"""Hostile bodies and authentication against a real server on 127.0.0.1.

Body size (413, announced or streamed, a 10 MB body included), content type (415), bodies that
are not UTF-8 JSON text, raw bytes or escapes (400, the connection survives), the API key (Bearer, as the ``openai``
client sends it), liveness while a long prompt is tokenized, and the gauges right after an
abort.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from multiguess.api.gate import text_problem
from multiguess.engine.config import EngineConfig

from tests.api.conftest import MODEL, LiveServer, tiny_loader
from tests.api.faults import Faults
from tests.api.helpers import metric

KEY = "sk-test-key-0123456789"
SMALL_CONFIG = EngineConfig(
    num_candidates=2, depth=2, max_nodes=4, max_batch=2, max_model_len=256, adaptive=False
)


@pytest.fixture(scope="module")
def loader(tiny_llama: Path, tiny_llama_draft: Path) -> Callable:
    return tiny_loader(tiny_llama, tiny_llama_draft, SMALL_CONFIG)


@pytest.fixture(scope="module")
def limited(start_server: Callable[..., LiveServer], loader: Callable) -> LiveServer:
    return start_server(loader, max_body=64 * 1024)


@pytest.fixture(scope="module")
def keyed(start_server: Callable[..., LiveServer], loader: Callable) -> LiveServer:
    return start_server(loader, api_key=KEY)


@pytest.fixture(scope="module")
def keyed_metrics(start_server: Callable[..., LiveServer], loader: Callable) -> LiveServer:
    return start_server(loader, api_key=KEY, protect_metrics=True)


def assert_error(resp: httpx.Response, status: int, words: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert words in resp.json()["error"]["message"]


def test_a_body_over_the_limit_is_413_announced_or_streamed(limited: LiveServer) -> None:
    big = b'{"prompt": "' + b"w1 " * 30_000 + b'"}'
    with limited.client() as client:
        assert_error(client.post("/generate", content=big, headers={"content-type": "application/json"}),
                     413, "limit of 65536 bytes")  # fmt: skip

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
            for i in range(0, len(big), 8192):
                yield big[i : i + 8192]

        streamed = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        assert_error(streamed, 413, "--max-body-size")
    with limited.client() as client:
        assert client.post("/generate", json={"prompt": "w1 w2", "max_tokens": 2}).status_code == 200


def test_a_refused_body_is_read_before_the_connection_closes(limited: LiveServer) -> None:
    """Closing a socket with unread data in it makes the kernel send a reset, which can destroy
    the 413 on its way; the server drains the refused body first, so the client reads the whole
    answer and then a clean end of stream."""
    host, port = limited.url.removeprefix("http://").split(":")
    body = b"x" * (2 * 64 * 1024)
    head = (
        f"POST /generate HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head + body)
        time.sleep(0.2)  # the server answers and closes before the client reads
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    status, _, rest = received.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert b"limit of 65536 bytes" in rest.partition(b"\r\n\r\n")[2]


def test_a_10_mb_body_is_refused_at_once_and_liveness_never_waits(server: LiveServer) -> None:
    body = b'{"prompt": "' + b"w1 " * 3_500_000 + b'"}'
    latencies: list[float] = []
    done, probing = threading.Event(), threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get("/health/live").status_code == 200
                latencies.append(time.monotonic() - started)
                probing.set()
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        assert probing.wait(10), "the liveness prober never got an answer"
        with server.client() as client:
            started = time.monotonic()
            resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            refused_in = time.monotonic() - started
    finally:
        done.set()
        prober.join()
    assert_error(resp, 413, "larger than the server's limit")
    assert refused_in < 5 and latencies and max(latencies) < 0.5


def test_liveness_answers_while_a_long_prompt_is_tokenized(server: LiveServer) -> None:
    """Tokenizing runs in a worker thread: health checks are answered meanwhile."""
    prompt = "w1 w2 " * 150_000  # 900 kB: seconds of tokenizing, within the body limit
    result: list[httpx.Response] = []

    def post() -> None:
        with server.client() as client:
            result.append(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}))

    poster = threading.Thread(target=post)
    poster.start()
    latencies = []
    with server.client() as client:
        while poster.is_alive():
            started = time.monotonic()
            assert client.get("/health/live").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.01)
    poster.join()
    assert_error(result[0], 400, "exceeds the context length")
    assert len(latencies) > 5 and max(latencies) < 0.5, (len(latencies), max(latencies))


SURROGATE = b"\xed\xa0\x80"  # U+D800 as UTF-8 would spell it: json.loads(bytes) lets it through


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/completions", b'{"prompt": "\\ud800x", "max_tokens": 2}', "not valid Unicode"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udc00"], "max_tokens": 2}', "not valid Unicode"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800x"}], "max_tokens": 2}',
            "not valid Unicode",
        ),
        ("/v1/completions", b'{"prompt": "w1", "stop": ["\\ud800"], "max_tokens": 2}', "not valid Unicode"),
        ("/generate", b'{"prompt": "\\ud800x"}', "not valid Unicode"),
        ("/v1/completions", b'{"prompt": "w1", "logit_bias": {"\\uDBFF": 1}}', "not valid Unicode"),
        (
            "/v1/completions",
            b'{"prompt": "w1", "response_format": {"type": "json_schema", "json_schema": '
            b'{"name": "x", "schema": {"properties": {"a": {"enum": [["\\udfff"]]}}}}}}',
            "not valid Unicode",
        ),
        ("/v1/completions", b'{"prompt": "hi' + SURROGATE + b'", "max_tokens": 4}', "not valid UTF-8"),
        (
            "/v1/completions",
            b'{"prompt": "hi' + SURROGATE + b'", "max_tokens": 4, "stream": true}',
            "not valid UTF-8",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi' + SURROGATE + b'"}]}',
            "not valid UTF-8",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi' + SURROGATE + b'"}], "stream": true}',
            "not valid UTF-8",
        ),
        ("/generate", b'{"prompt": "hi' + SURROGATE + b'"}', "not valid UTF-8"),
        ("/v1/completions", b'{"prompt": "w1", "guided_regex": "a' + SURROGATE + b'"}', "not valid UTF-8"),
        ("/v1/completions", b'{"prompt": "w1", "max_tokens": 2, "stop": ["\xff"]}', "not valid UTF-8"),
        ("/v1/completions", b'{"prompt": "caf\xe9", "max_tokens": 2}', "not valid UTF-8"),  # Latin-1
        ("/v1/completions", '{"prompt": "w1", "max_tokens": 2}'.encode("utf-16"), "not valid UTF-8"),
        ("/v1/completions", '{"prompt": "w1", "max_tokens": 2}'.encode("utf-16-le"), "NUL bytes"),
        ("/generate", '{"prompt": "w1", "max_tokens": 2}'.encode("utf-32-be"), "NUL bytes"),
    ],
)
def test_a_body_that_is_not_utf8_json_text_is_400_and_the_connection_survives(
    server: LiveServer, path: str, body: bytes, words: str
) -> None:
    with server.client() as client:
        assert_error(
            client.post(path, content=body, headers={"content-type": "application/json"}), 400, words
        )
        again = client.post("/generate", json={"prompt": "w1 \U0001f600 w2", "max_tokens": 2})
        assert again.status_code == 200, again.text


def test_valid_text_passes_and_lone_surrogates_are_found_at_any_depth() -> None:
    assert text_problem('{"prompt": "w1 \U0001f600 \\u00e9 \\ud83d\\ude00"}'.encode()) is None
    assert text_problem(b'{"prompt": "\\\\ud800"}') is None  # an escaped backslash, then text
    assert text_problem(b"[" * 100_000 + b'"\\ud800"') is None  # too deep: the app says so
    assert "lone surrogate" in str(text_problem(b'{"a": {"b": ["\\udabc"]}}'))


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
def test_post_bodies_must_be_json(server: LiveServer, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    with server.client() as client:
        resp = client.post("/generate", content=b'{"prompt": "w1", "max_tokens": 2}', headers=headers)
        assert_error(resp, 415, "Content-Type: application/json")
        ok = client.post("/generate", content=b'{"prompt": "w1", "max_tokens": 2}',
                         headers={"content-type": "application/json; charset=utf-8"})  # fmt: skip
        assert ok.status_code == 200


def test_the_api_key_is_checked_as_openai_clients_send_it(keyed: LiveServer) -> None:
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0)
    reply = good.completions.create(model=MODEL, prompt="w1 w2", max_tokens=3, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert [m.id for m in good.models.list()] == [MODEL]
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], max_tokens=2)
    with keyed.client() as client:
        for path in ("/generate", "/v1/completions"):
            resp = client.post(path, json={"prompt": "w1", "max_tokens": 2})
            assert_error(resp, 401, "Authorization: Bearer")
            assert resp.headers["www-authenticate"] == "Bearer"
        assert client.get("/v1/models", headers={"authorization": f"Basic {KEY}"}).status_code == 401
        # Health checks (probes) and metrics (scrapers) stay open by default.
        assert client.get("/health/live").status_code == 200
        assert client.get("/health/ready").status_code == 200
        assert client.get("/metrics").status_code == 200


def test_metrics_can_be_protected_too(keyed_metrics: LiveServer) -> None:
    with keyed_metrics.client() as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert client.get("/health/live").status_code == 200


def test_gauges_are_right_at_an_abort(
    start_server: Callable[..., LiveServer], tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """A client that leaves is reflected at once: no step follows to refresh the gauges."""
    # At least 0.1 s per step: the request runs for 8 s or more unless it is aborted.
    slow = tiny_loader(tiny_llama, tiny_llama_draft, SMALL_CONFIG, faults=Faults(delay=0.1))
    live = start_server(slow, max_queue=4)
    body = {"prompt": "w3 w4", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
    with live.client() as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            next(line for line in resp.iter_lines() if line.startswith("data: "))
            deadline = time.monotonic() + 20  # the step posts its tokens before it sets the gauges
            while metric(client, "multiguess_requests_running") != 1:
                assert time.monotonic() < deadline, "requests_running never showed the running request"
                time.sleep(0.01)
        deadline = time.monotonic() + 5
        while metric(client, "multiguess_requests_running") != 0:
            assert time.monotonic() < deadline, "requests_running stayed at 1 after the abort"
            time.sleep(0.02)
        assert metric(client, "multiguess_requests_waiting") == 0
        assert not live.engine.has_unfinished()
