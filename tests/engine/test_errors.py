"""Bad input gets a clear error naming what is wrong, and the engine keeps working after it."""

from pathlib import Path

import pytest
from multiguess import LLM, SamplingParams
from multiguess.errors import (
    IncompatibleDraftError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)
from transformers import GPT2Config

from tests.tiny_models import build_tokenizer, model_config, save_model


def test_unknown_model_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot load model"):
        LLM(str(tmp_path / "missing"), None)


def test_unsupported_architecture(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)
    folder = save_model(tmp_path / "gpt2", config, 0, tokenizer)
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported; supported: llama"):
        LLM(str(folder), None)


def test_draft_with_another_vocabulary_is_refused(tmp_path: Path, tiny_llama: Path) -> None:
    other = build_tokenizer([f"v{i}" for i in range(60)])
    folder = save_model(tmp_path / "other", model_config("llama", len(other)), 0, other)
    with pytest.raises(IncompatibleDraftError, match="different vocabulary"):
        LLM(str(tiny_llama), str(folder))


def test_draft_with_other_special_tokens_is_refused(tmp_path: Path, tiny_llama: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.eos_token = "<pad>"
    folder = save_model(tmp_path / "eos", model_config("llama", len(tokenizer)), 0, tokenizer)
    with pytest.raises(IncompatibleDraftError, match="eos_token_id"):
        LLM(str(tiny_llama), str(folder))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_candidates": 0}, "num_candidates must be at least 1"),
        ({"depth": 0}, "depth must be at least 1"),
        ({"max_nodes": 0}, "max_nodes must be at least 1"),
        ({"dtype": "int4"}, "dtype must be one of"),
        ({"drafter": "magic"}, "drafter must be one of"),
    ],
)
def test_bad_engine_settings(tiny_llama: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), None, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"n": 0}, "n must be at least 1"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"stop": [""]}, "stop strings must not be empty"),
    ],
)
def test_bad_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_alone(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), None, dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]])
    with pytest.raises(InvalidRequestError, match="exceeds the context length of 64"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=8))
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        llm.generate([[5, 10_000]])
    with pytest.raises(InvalidRequestError, match="at most the server's"):
        llm.generate([[5, 6]], SamplingParams(depth=9))
    # A batch with one bad prompt fails whole and leaves nothing behind in the engine.
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], []])
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_stop_strings_end_generation(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), None, dtype="float32")
    full = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    words = full.text.split()
    cut = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True, stop=[words[3]]))[0]
    assert cut.outputs[0].finish_reason == "stop"
    assert words[3] not in cut.text
    assert full.text.startswith(cut.text)
