"""One request cannot stall the rest, against a real server: an ``n`` > 1 request computes its
prompt's log-probabilities once, and liveness answers fast while a long echoed request with
log-probabilities and a stream run."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from multiguess.engine import engine as engine_module
from multiguess.engine.config import EngineConfig

from tests.api.conftest import MODEL, LiveServer, tiny_loader
from tests.engine.test_lossless import random_prompts

LIVENESS_LIMIT = 0.1  # seconds


@pytest.fixture(scope="module")
def wide(start_server: Callable[..., LiveServer], tiny_llama: Path) -> LiveServer:
    """Plain decoding with room for a 500-token prompt, prefilled 32 tokens per step."""
    config = EngineConfig(max_batch=8, max_model_len=512, adaptive=False, max_prefill_tokens=32)
    return start_server(tiny_loader(tiny_llama, None, config), max_queue=16, request_timeout=120)


def echoed(client: httpx.Client, prompt: list[int], n: int) -> list[list[float | None]]:
    """Each choice's log-probabilities of the echoed prompt."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 3, "n": n}
    resp = client.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 5})
    assert resp.status_code == 200, resp.text
    return [c["logprobs"]["token_logprobs"][: len(prompt)] for c in resp.json()["choices"]]


def test_n_samples_compute_their_prompts_logprobs_once(
    wide: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows: list[int] = []
    compute = engine_module.prompt_logprobs

    def counted(logits: torch.Tensor, tokens: list[int], top: int) -> object:
        rows.append(len(tokens))
        return compute(logits, tokens, top)

    monkeypatch.setattr(engine_module, "prompt_logprobs", counted)
    (prompt,) = random_prompts(89, (120,))
    with wide.client() as client:
        (alone,) = echoed(client, prompt, 1)
        rows.clear()
        together = echoed(client, prompt, 4)
    assert sum(rows) == len(prompt) - 1  # once, not once per choice
    assert alone[0] is None and all(choice == alone for choice in together)


PROBE = """
import sys, time, httpx
with httpx.Client(base_url=sys.argv[1]) as client:
    while not sys.stdin.readline().strip():  # an empty line per probe; "stop" ends
        started = time.perf_counter()
        assert client.get("/health/live").status_code == 200
        print(time.perf_counter() - started, flush=True)
"""


def test_liveness_answers_fast_while_a_long_echo_and_a_stream_run(wide: LiveServer) -> None:
    """Probed every 20 ms from another process (a prober in this one would wait for the
    interpreter lock itself): for a second while only a stream runs, then while the heavy
    request runs too. A loaded machine delays any answer, so the bound is the limit on top of
    the worst answer without the heavy request."""
    (prompt,) = random_prompts(97, (500,))
    heavy = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 20, "n": 8}
    stream = {"model": MODEL, "prompt": "w3 w4", "max_tokens": 400, "ignore_eos": True, "stream": True}
    done = threading.Event()
    latencies: list[float] = []
    prober = subprocess.Popen(
        [sys.executable, "-c", PROBE, wide.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert prober.stdin is not None and prober.stdout is not None

    def pace() -> None:
        while not done.is_set():
            prober.stdin.write("\n")  # type: ignore[union-attr]
            prober.stdin.flush()  # type: ignore[union-attr]
            latencies.append(float(prober.stdout.readline()))  # type: ignore[union-attr]
            time.sleep(0.02)

    pacer = threading.Thread(target=pace)
    with wide.client() as client, client.stream("POST", "/v1/completions", json=stream) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        pacer.start()
        time.sleep(1.0)
        calm = len(latencies)
        try:
            resp = client.post("/v1/completions", json={**heavy, "temperature": 1.0})
        finally:
            done.set()
            pacer.join()
            prober.communicate("stop\n", timeout=30)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == 8
        list(lines)
    baseline, loaded = latencies[:calm], latencies[calm:]
    assert len(baseline) >= 5 and len(loaded) >= 3
    assert max(loaded) < LIVENESS_LIMIT + max(baseline), (max(loaded), max(baseline))
