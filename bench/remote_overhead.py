"""Per-step cost of drafting through a draft server on loopback, against the local drafter.

Two measurements, both medians over repeats:

* ``transport``: the round trip of a realistic step message (a 4-sequence batch of requests
  and a reply with four 16-node trees) on loopback, over a WebSocket (what the protocol uses)
  and over HTTP/1.1 keep-alive POSTs (httpx), both served by uvicorn. This is why the
  protocol is a WebSocket.
* ``engine``: the embedded pair, greedy, the same prompts decoded with the local
  ``ModelDrafter`` and with ``RemoteDrafter`` against ``multiguess serve-draft`` running as its own
  process on 127.0.0.1: ms per draft step, its wire share (round trip minus the server's own
  compute), bytes sent per step, ms per engine step and tokens/s. With ``--drafter eagle3`` the
  drafter is an EAGLE-3 head (``--head``; default: one of random weights for the embedded
  target, since acceptance does not matter for the overhead), local and on the draft server, so
  the features travel; its JSON goes to ``remote-overhead-eagle3.json``.

    .venv/bin/python bench/remote_overhead.py     # JSON into docs/bench/, BENCHMARKS.md rendered again
    .venv/bin/python bench/remote_overhead.py --drafter eagle3 --skip-transport
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_docs
import httpx
import torch
import uvicorn
from local_server import free_port, start_ready
from multiguess.drafting import DraftOptions, Serving, build_drafter, remote_drafter
from multiguess.engine.config import EngineConfig
from multiguess.engine.drafter import TreeBudget
from multiguess.engine.drafters.base import Drafter, WrappedDrafter
from multiguess.engine.engine import Engine
from multiguess.engine.tree import TokenTree
from multiguess.llm import load_pair
from multiguess.params import SamplingParams
from multiguess.provenance import provenance
from multiguess.remote.client import RemoteDrafter
from multiguess.remote.protocol import Drafted, Request, StepMessage, StepReply, encode_reply, encode_step
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.sync.client import connect

PROMPTS = Path(__file__).resolve().parents[1] / "server" / "multiguess" / "data" / "bench_prompts.json"
EAGLE3_FILE = "remote-overhead-eagle3.json"


def sample_frames() -> tuple[bytes, bytes]:
    """A typical greedy step of a 4-sequence batch: a few new tokens each, 16-node trees back."""
    budget = TreeBudget(3, 4, 16)
    message = StepMessage(requests=tuple(Request(s, 300, (1000 + s, 2000, 3000), budget) for s in range(4)))
    tree = TokenTree(tuple(range(17)), (-1, *(i // 3 for i in range(16))))
    return encode_step(message), encode_reply(StepReply([Drafted(tree)] * 4))


def median_us(call: Callable[[], object], repeats: int) -> float:
    for _ in range(50):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def transport(repeats: int) -> dict[str, Any]:
    request, reply = sample_frames()

    async def post(http: HttpRequest) -> Response:
        await http.body()
        return Response(reply, media_type="application/octet-stream")

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                await websocket.receive_bytes()
                await websocket.send_bytes(reply)

    app = Starlette(routes=[Route("/step", post, methods=["POST"]), WebSocketRoute("/ws", echo)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error", ws="websockets-sansio"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    results = {"request_bytes": len(request), "reply_bytes": len(reply)}
    with httpx.Client() as client:
        results["http_post_us"] = median_us(
            lambda: client.post(f"http://127.0.0.1:{port}/step", content=request).content, repeats
        )
    with connect(f"ws://127.0.0.1:{port}/ws", compression=None) as ws:
        results["websocket_us"] = median_us(lambda: (ws.send(request), ws.recv()), repeats)
    server.should_exit = True
    return results


class Timed(WrappedDrafter):
    """Wraps a drafter and records how long each ``propose`` took (and, for a remote drafter,
    the part of it not spent computing on the server)."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self.times: list[float] = []
        self.wire: list[float] = []

    def propose(self, requests: list) -> list:
        start = time.perf_counter()
        proposals = self.inner.propose(requests)
        self.times.append(time.perf_counter() - start)
        if isinstance(self.inner, RemoteDrafter):
            round_trip, server = self.inner.last_timing
            self.wire.append(round_trip - server)
        return proposals


def decode(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{time.perf_counter_ns()}-{i}", ids, params)
    steps, tokens = [], 0
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t)
        tokens += sum(len(o.new_token_ids) for o in outputs)
    elapsed = time.perf_counter() - start
    return {"step_ms": statistics.median(steps) * 1e3, "tokens_per_s": tokens / elapsed}


def start_draft_server(port: int, threads: int, head: Path | None) -> subprocess.Popen:
    env = os.environ | {
        "MULTIGUESS_PORT": str(port),
        "MULTIGUESS_HOST": "127.0.0.1",
        "MULTIGUESS_LOG_LEVEL": "warning",
        "OMP_NUM_THREADS": str(threads),
    }
    if head is not None:  # the embedded target's head: serve-draft reads the target's embeddings
        env |= {"MULTIGUESS_DRAFTER": "eagle3", "MULTIGUESS_DRAFT": str(head)}
    return start_ready([sys.executable, "-m", "multiguess.cli", "serve-draft"], env, port, 300, quiet=False)


def random_head(target: Any, folder: Path) -> Path:
    """An EAGLE-3 head of random weights for ``target``, in the checkpoint layout."""
    from multiguess.distill.eagle3_train import build_head
    from multiguess.models.eagle3_checkpoint import save_head

    vocab = target.model.config.vocab_size
    save_head(build_head(target.model, torch.arange(vocab), seed=0), folder, target.dtype)
    return folder


def engine_comparison(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    eagle3 = args.drafter == "eagle3"
    target, draft = load_pair(None, None, "auto", "cpu", None, None, speculate=not eagle3)
    texts = [p["text"] for p in json.loads(PROMPTS.read_text())["prompts"]][: args.batch]
    chat = [[{"role": "user", "content": t}] for t in texts]
    tok = target.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)) for c in chat
    ]
    # Fixed trees: the adaptive policy may stop drafting, and this measures a drafting step.
    config = EngineConfig(
        args.num_candidates, args.depth, args.max_nodes, max_batch=args.batch, adaptive=False
    )
    scratch = tempfile.TemporaryDirectory()
    head = (args.head or random_head(target, Path(scratch.name) / "head")) if eagle3 else None
    drafter = build_drafter(args.drafter, target, DraftOptions(str(head) if head else None, loaded=draft))
    assert drafter is not None
    local_timer = Timed(drafter)
    local = Engine(target, local_timer, config)
    port = free_port()
    server = start_draft_server(port, args.threads, head)
    try:
        client = remote_drafter(target, Serving(step_timeout=60, url=f"http://127.0.0.1:{port}"))
        assert isinstance(client, RemoteDrafter)
        remote_timer = Timed(client)
        remote = Engine(target, remote_timer, config)
        runs: dict[str, list[dict[str, float]]] = {"local": [], "remote": []}
        decode(local, prompts, 8)  # warm both paths up
        decode(remote, prompts, 8)
        for timer in (local_timer, remote_timer):
            timer.times.clear()
            timer.wire.clear()
        sent_before = client.metrics.registry.get_sample_value("multiguess_remote_draft_sent_bytes_total")
        for _ in range(args.repeats):
            runs["local"].append(decode(local, prompts, args.max_tokens))
            runs["remote"].append(decode(remote, prompts, args.max_tokens))
        sent = (
            client.metrics.registry.get_sample_value("multiguess_remote_draft_sent_bytes_total") - sent_before
        )
    finally:
        server.terminate()
        server.wait(30)
        scratch.cleanup()
    result: dict[str, Any] = {
        "drafter": args.drafter,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads_per_process": args.threads,
        "tree": [args.num_candidates, args.depth, args.max_nodes],
    }
    for name, timer in (("local", local_timer), ("remote", remote_timer)):
        result[name] = {
            "draft_ms": statistics.median(timer.times) * 1e3,
            "step_ms": statistics.median(r["step_ms"] for r in runs[name]),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[name]),
        }
    wire = sorted(remote_timer.wire)
    result["remote"]["wire_ms_median"] = statistics.median(wire) * 1e3
    result["remote"]["wire_ms_p90"] = wire[int(0.9 * (len(wire) - 1))] * 1e3
    result["remote"]["steps"] = len(wire)
    result["remote"]["sent_bytes_per_step"] = sent / len(wire)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="decoding runs per drafter (medians)")
    parser.add_argument("--transport-repeats", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-candidates", type=int, default=3)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--max-nodes", type=int, default=16)
    parser.add_argument("--skip-engine", action="store_true", help="transport only (no models)")
    parser.add_argument("--skip-transport", action="store_true", help="engine only")
    parser.add_argument("--drafter", choices=("model", "eagle3"), default="model")
    parser.add_argument("--head", type=Path, help="eagle3: the head's folder (default: random weights)")
    parser.add_argument(
        "--out", type=Path, default=Path("docs"), help="docs folder: bench/ JSON and BENCHMARKS.md"
    )
    args = parser.parse_args()
    results: dict[str, Any] = {**provenance(), "load_average": os.getloadavg()[0]}
    if not args.skip_transport:
        results["transport"] = transport(args.transport_repeats)
    if not args.skip_engine:
        results["engine"] = engine_comparison(args)
    text = json.dumps(results, indent=2)
    print(text)
    (args.out / "bench").mkdir(parents=True, exist_ok=True)
    name = EAGLE3_FILE if args.drafter == "eagle3" else bench_docs.REMOTE_FILE
    (args.out / "bench" / name).write_text(text + "\n")
    bench_docs.write(args.out)


if __name__ == "__main__":
    main()
