"""Shared fixtures: tiny models built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import build_tokenizer, model_config, save_model, save_noisy_copy


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
def tiny_qwen2_draft(tiny_dir: Path, tiny_qwen2: Path) -> Path:
    return save_noisy_copy(tiny_qwen2, tiny_dir / "qwen2-draft", noise=0.5, seed=3)
