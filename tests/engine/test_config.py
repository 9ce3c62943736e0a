"""The configuration is written once (``engine/config.py``): the engine flags and ``LLM()``'s
parameters are made from its fields, so they cannot drift from it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import subprocess
import sys

import pytest
from multiguess.cli import build_parser
from multiguess.commands.engine_args import add_engine_args, engine_config, given
from multiguess.engine.config import EngineConfig, ModelConfig, split_options
from multiguess.flags import flags
from multiguess.llm import LLM


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_no_flags_give_the_records_defaults() -> None:
    args = parse()
    assert engine_config(args) == EngineConfig()
    assert ModelConfig(**given(ModelConfig, args)) == ModelConfig()


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_every_command_that_builds_an_engine_has_every_flag(command: str) -> None:
    args = build_parser().parse_args([command, *(["--prompt", "hi"] if command == "generate" else [])])
    for record in (ModelConfig, EngineConfig):
        for field, flag in flags(record):
            assert flag.value(args) == field.default, flag.name


def test_flags_set_their_fields() -> None:
    args = parse(
        "--num-candidates=2",
        "--depth=6",
        "--no-adaptive",
        "--full-draft-vocab",
        "--cuda-graphs",
        "--max-prefill-tokens=0",
        "--no-enable-prefix-caching",
        "--prompt-lookup=0",
        "--drafter=ngram",
        "--dtype=float32",
    )
    config = engine_config(args)
    assert (config.num_candidates, config.depth, config.adaptive, config.draft_vocab) == (2, 6, False, False)
    assert (config.cuda_graphs, config.max_prefill_tokens, config.prefix_caching) == (True, None, False)
    assert config.prompt_lookup == 0
    assert ModelConfig(**given(ModelConfig, args)) == ModelConfig(drafter="ngram", dtype="float32")


def test_switches_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MULTIGUESS_NO_ADAPTIVE", "1")
    monkeypatch.setenv("MULTIGUESS_ENABLE_PREFIX_CACHING", "no")
    monkeypatch.setenv("MULTIGUESS_MAX_PREFILL_TOKENS", "64")
    config = engine_config(parse())
    assert (config.adaptive, config.prefix_caching, config.max_prefill_tokens) == (False, False, 64)


def test_llm_takes_every_field_with_its_default() -> None:
    fields = {f.name: f for record in (ModelConfig, EngineConfig) for f in dataclasses.fields(record)}
    parameters = inspect.signature(LLM).parameters
    assert set(parameters) == set(fields)
    for name, parameter in parameters.items():
        field = fields[name]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        assert parameter.default == default, name
    assert list(parameters)[:4] == ["target", "draft", "num_candidates", "depth"]


def test_llm_arguments_split_into_the_records() -> None:
    bound = LLM.SIGNATURE.bind("t", None, 2, 5, dtype="float32", prompt_lookup=0)
    model, config = split_options(bound.arguments)
    assert model == ModelConfig(target="t", dtype="float32")
    assert config == EngineConfig(2, 5, prompt_lookup=0)
    with pytest.raises(TypeError, match="num_candidate"):
        LLM(num_candidate=2)


def test_the_cli_builds_its_flags_without_torch() -> None:
    """``multiguess --help`` stays instant, and serve sets OpenMP's spin before torch loads."""
    probe = (
        "import sys; from multiguess.cli import build_parser; build_parser(); "
        "print(sorted({k.split('.')[0] for k in sys.modules} & {'torch', 'transformers'}))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
