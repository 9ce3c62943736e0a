"""Shared fixtures: tiny models built once per test session."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiny_models import build_text_tokenizer, build_tokenizer, model_config, save_model, save_noisy_copy


@pytest.fixture(scope="session", autouse=True)
def whole_prefill_chunks() -> Iterator[None]:
    """``max_prefill_tokens="auto"`` measures its chunk on the machine at hand, and a tiny
    model's forwards cost about the same at any length, so its chunk would follow timing noise.
    Here the measurement admits every size (a prompt is prefilled whole, in a known number of
    steps); the tests of chunking set their chunk or patch the pause. Collection has imported
    the engine by now when any test uses it (sessions without it import no torch)."""
    module = sys.modules.get("multiguess.engine.engine")
    if module is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "PREFILL_PAUSE_STEPS", math.inf)
        yield


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir: Path) -> Path:
    tokenizer = build_tokenizer()
    return save_model(tiny_dir / "llama", model_config("llama", len(tokenizer)), 0, tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_dir: Path) -> Path:
    tokenizer = build_tokenizer()
    return save_model(tiny_dir / "qwen2", model_config("qwen2", len(tokenizer)), 1, tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_draft(tiny_dir: Path, tiny_llama: Path) -> Path:
    return save_noisy_copy(tiny_llama, tiny_dir / "llama-draft", noise=0.5, seed=2)


@pytest.fixture(scope="session")
def tiny_text_llama(tiny_dir: Path) -> Path:
    """A tiny target with a byte-level BPE tokenizer: grammars can constrain what it writes."""
    tokenizer = build_text_tokenizer()
    return save_model(tiny_dir / "text-llama", model_config("llama", len(tokenizer)), 11, tokenizer)


@pytest.fixture(scope="session")
def tiny_text_llama_draft(tiny_dir: Path, tiny_text_llama: Path) -> Path:
    return save_noisy_copy(tiny_text_llama, tiny_dir / "text-llama-draft", noise=0.5, seed=12)


@pytest.fixture(scope="session")
def tiny_qwen2_draft(tiny_dir: Path, tiny_qwen2: Path) -> Path:
    return save_noisy_copy(tiny_qwen2, tiny_dir / "qwen2-draft", noise=0.5, seed=3)


@pytest.fixture(scope="session")
def gqa_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Heads shaped like the embedded target's (9 query heads over 3 of 64 wide), 4 layers:
    enough that torch's attention gives a tree row and a lone token different last bits."""
    folder = tmp_path_factory.mktemp("gqa")
    tokenizer = build_tokenizer()
    shape = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=4)
    target = save_model(folder / "target", model_config("llama", len(tokenizer), **shape), 7, tokenizer)
    return target, save_noisy_copy(target, folder / "draft", noise=0.3, seed=8)
