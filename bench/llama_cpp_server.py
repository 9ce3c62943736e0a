"""One ``llama-server`` process for the benchmark: its command line, its start, greedy completions.

Prompts go in as token ids, so llama.cpp decodes exactly the tokens multiguess decodes (the
chat template applied once, by the target's tokenizer). Each request asks for greedy decoding
with the prompt cache off (every repeat prefills again, as multiguess's engines do with their
prefix cache off) and returns the generated token ids with the server's own timings.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTEXT = 1024  # prompt (~30-150 tokens) and reply (96) of every benchmark prompt


@dataclass(frozen=True)
class ServerConfig:
    """What one server runs: a model, optionally a draft with its longest draft, threads, and
    flags added as given (``bench/llama_cpp.py --llama-args``)."""

    model: Path
    threads: int
    draft: Path | None = None
    draft_max: int = 4
    extra: tuple[str, ...] = ()


def server_command(binary: Path, config: ServerConfig, port: int) -> list[str]:
    """The ``llama-server`` command line: CPU only, one slot, ``threads`` for the target and the
    draft alike. A draft model drafts with ``--spec-type draft-simple`` (a plain Llama draft
    names no type in its GGUF, and without one the server loads it but never drafts), at most
    ``draft_max`` tokens a step."""
    threads = str(config.threads)
    command = [str(binary), "-m", str(config.model), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-t", threads, "-tb", threads, "-c", str(CONTEXT), "-np", "1", "-ngl", "0"]
    if config.draft is not None:
        command += ["-md", str(config.draft), "-td", threads, "-tbd", threads, "-ngld", "0"]
        command += ["--spec-type", "draft-simple", "--spec-draft-n-max", str(config.draft_max)]
        command += ["--spec-draft-n-min", "0"]
    return command + list(config.extra)


def completion_request(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A ``/completion`` body: greedy (temperature 0 is argmax in llama.cpp), no prompt cache,
    the generated ids returned."""
    return {
        "prompt": prompt,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


@dataclass(frozen=True)
class Timings:
    """llama-server's own account of one completion (its ``timings`` object)."""

    prompt_tokens: int
    prompt_ms: float
    predicted_tokens: int
    predicted_ms: float
    drafted: int = 0
    accepted: int = 0

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens over the decode time alone (the prompt's prefill left out)."""
        return self.predicted_tokens / (self.predicted_ms / 1000) if self.predicted_ms else 0.0


def parse_timings(body: dict[str, Any]) -> Timings:
    """The ``timings`` of a ``/completion`` response; ``draft_n`` and ``draft_n_accepted`` appear
    only where the server drafted something."""
    t = body["timings"]
    return Timings(
        prompt_tokens=int(t["prompt_n"]),
        prompt_ms=float(t["prompt_ms"]),
        predicted_tokens=int(t["predicted_n"]),
        predicted_ms=float(t["predicted_ms"]),
        drafted=int(t.get("draft_n", 0)),
        accepted=int(t.get("draft_n_accepted", 0)),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaServer:
    """A running ``llama-server``; a context manager that stops it on exit."""

    def __init__(self, binary: Path, config: ServerConfig, log: Path, timeout: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = server_command(binary, config, self.port)
        self.log = log.open("w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Poll ``/health`` until the model is loaded (200), or fail with the log's path."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama-server not ready after {timeout:.0f} s; see {self.log.name}")

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[list[int], Timings]:
        """Greedy completion of ``prompt``: the generated ids and the server's timings."""
        data = json.dumps(completion_request(prompt, max_tokens)).encode()
        request = urllib.request.Request(
            f"{self.url}/completion", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as reply:
            body = json.loads(reply.read())
        return [int(t) for t in body["tokens"]], parse_timings(body)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
