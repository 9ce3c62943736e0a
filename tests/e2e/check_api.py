"""Talk to a deployed multiguess server the way users do; exit non-zero with a reason on failure.

Used by the e2e scripts through a port-forward (tests/e2e/lib.sh):

    python tests/e2e/check_api.py http://127.0.0.1:18000                       # API + metrics
    python tests/e2e/check_api.py http://127.0.0.1:18000 --load-seconds 90     # sustained load
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI, OpenAIError
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "Explain speculative decoding in one sentence."


class CheckFailed(AssertionError):
    """The server answered, but not as the contract in DESIGN.md says."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def wait_ready(client: httpx.Client, timeout_s: float = 300.0) -> None:
    """Poll /health/ready until 200: the port-forward and the model load both take a while."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = client.get("/health/ready")
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as error:
            last = repr(error)
        time.sleep(2)
    raise CheckFailed(f"/health/ready never returned 200 within {timeout_s:.0f} s: {last}")


def counters(client: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics, summed over labels, by sample name."""
    response = client.get("/metrics")
    expect(response.status_code == 200, f"/metrics answered {response.status_code}")
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def check_generate(client: httpx.Client) -> None:
    response = client.post("/generate", json={"prompt": PROMPT})
    expect(response.status_code == 200, f"/generate answered {response.status_code}: {response.text[:300]}")
    result = response.json().get("result")
    expect(
        isinstance(result, str) and bool(result.strip()), f"/generate returned no text: {response.text[:300]}"
    )


def check_openai(base_url: str) -> None:
    """The official OpenAI client against /v1: models, completions, streamed chat."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300)
    models = [model.id for model in client.models.list().data]
    expect(bool(models), "/v1/models lists no model")
    completion = client.completions.create(model=models[0], prompt=PROMPT, max_tokens=16, temperature=0)
    expect(bool(completion.choices[0].text.strip()), "/v1/completions returned no text")
    stream = client.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": PROMPT}], max_tokens=16, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    expect(bool("".join(pieces).strip()), "streamed /v1/chat/completions returned no text")


def check_metrics(before: dict[str, float], after: dict[str, float], requests: int) -> None:
    def grew(name: str, by: float) -> bool:
        return after.get(name, 0.0) - before.get(name, 0.0) >= by

    expect(grew("multiguess_generation_tokens_total", requests), "generation_tokens_total did not grow")
    expect(grew("multiguess_request_queue_seconds_count", requests), "request_queue_seconds did not count")
    expect(grew("multiguess_e2e_request_seconds_count", requests), "e2e_request_seconds did not count")
    expect(grew("multiguess_spec_verify_steps_total", 1), "no speculative verify step was recorded")


def settle_metrics(
    client: httpx.Client, before: dict[str, float], requests: int, seconds: float = 5.0
) -> None:
    """``check_metrics``, retried briefly: a streamed response's last chunk reaches the client
    before the server records the request's end-to-end time, so one scrape can race it."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            check_metrics(before, counters(client), requests)
            return
        except CheckFailed:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run_load(base_url: str, seconds: float, concurrency: int) -> int:
    """/generate from `concurrency` clients for `seconds`; the number of successful requests."""
    deadline = time.monotonic() + seconds

    def worker(_: int) -> int:
        done = 0
        with httpx.Client(base_url=base_url, timeout=300) as client:
            while time.monotonic() < deadline:
                if client.post("/generate", json={"prompt": PROMPT}).status_code == 200:
                    done += 1
        return done

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(worker, range(concurrency)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url")
    parser.add_argument("--load-seconds", type=float, default=0.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds to wait for /health/ready"
    )
    args = parser.parse_args(argv)
    base_url = args.base_url.rstrip("/")
    with httpx.Client(base_url=base_url, timeout=300) as client:
        try:
            wait_ready(client, args.ready_timeout)
            if args.load_seconds > 0:
                served = run_load(base_url, args.load_seconds, args.concurrency)
                expect(served > 0, "no request succeeded under load")
                print(f"ok: {served} requests in {args.load_seconds:.0f} s of load")
                return 0
            before = counters(client)
            check_generate(client)
            check_openai(base_url)
            settle_metrics(client, before, requests=3)
            print("ok: /generate, /v1/completions, streamed /v1/chat/completions, /metrics")
        except (CheckFailed, httpx.HTTPError, OpenAIError) as error:
            print(f"check_api FAILED: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
