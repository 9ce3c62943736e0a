"""The remote drafter's proposals meet the target's tensors on the target's device (see
tests/engine/test_device_hygiene.py): what arrives over the network starts on the host."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from multiguess.models.loading import load_model

from tests.engine.test_device_hygiene import SAMPLED, on_device
from tests.engine.test_lossless import random_prompts
from tests.remote.conftest import DraftServer, add_all, finish, remote_engine


def test_remote_drafting_stays_on_the_device(
    tiny_llama: Path, draft_server: Callable[..., DraftServer]
) -> None:
    server = draft_server()
    engine, _ = remote_engine(load_model(str(tiny_llama), dtype="float32"), server.url)
    prompts = random_prompts(24, (6, 14))

    def run() -> None:
        add_all(engine, prompts, 10)
        for i, params in enumerate(SAMPLED):
            engine.add_request(f"s{i}", prompts[i % len(prompts)], params)
        finish(engine)

    _, caught = on_device(engine, run)
    assert caught == []
    assert engine.totals.accepted_tokens > 0 and engine.totals.fallback_steps == 0
