"""A misbehaving draft server: it completes the handshake like ``serve-draft`` (the target's
tokenizer fingerprint, so the target connects), then answers every request with a tree the
target must not verify. Real uvicorn on 127.0.0.1, real WebSocket frames."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import torch
import uvicorn
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from multiguess.engine.tree import TokenTree
from multiguess.remote import handshake
from multiguess.remote.protocol import (
    PATH,
    Drafted,
    Request,
    ServerInfo,
    StepReply,
    decode_step,
    encode_reply,
)

# What each mode answers for a request (the vocabulary size is the target's).
BAD_TREES: dict[str, Callable[[Request, int], Drafted]] = {
    "out_of_vocabulary": lambda r, v: Drafted(TokenTree((r.tokens[-1], v + 5), (-1, 0))),
    "wrong_root": lambda r, v: Drafted(TokenTree(((r.tokens[-1] + 1) % v, 3), (-1, 0))),
    "too_deep": lambda r, v: Drafted(TokenTree.chain([r.tokens[-1], *[3] * (r.budget.depth + 1)])),
    "child_without_mass": lambda r, v: Drafted(TokenTree((r.tokens[-1], 3), (-1, 0)), {0: torch.eye(v)[4]}),
    "nan_rows": lambda r, v: Drafted(
        TokenTree((r.tokens[-1], 3), (-1, 0)), {0: torch.full((v,), float("nan"))}
    ),
}


def hostile_app(info: ServerInfo, mode: str) -> FastAPI:
    app = FastAPI()
    answer = BAD_TREES[mode]

    @app.get("/health/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.websocket(PATH)
    async def draft(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            hello = handshake.parse_client_hello(await websocket.receive_text())
            await websocket.send_text(handshake.challenge(handshake.new_nonce(), hello.nonce, None))
            await websocket.receive_text()
            await websocket.send_text(info.to_json())
            while True:
                message = decode_step(await websocket.receive_bytes())
                results = [answer(r, info.vocab_size) for r in message.requests]
                await websocket.send_bytes(encode_reply(StepReply(results)))  # type: ignore[arg-type]
        except WebSocketDisconnect:
            return

    return app


class HostileDraftServer:
    def __init__(self, info: ServerInfo, mode: str) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(hostile_app(info, mode), log_level="warning", ws="websockets-sansio")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
