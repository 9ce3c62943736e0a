"""The embedded default pair: cache location, atomic conversion, idempotency, the CLI command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multiguess import cache_dirs, cli
from multiguess.models import embedded


def test_cache_root_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MULTIGUESS_CACHE", str(tmp_path / "c"))
    assert cache_dirs.cache_roots()[0] == tmp_path / "c"
    monkeypatch.delenv("MULTIGUESS_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dirs.cache_roots()[0] == tmp_path / ".cache" / "multiguess"


def test_target_gguf_is_found_without_importing_its_package() -> None:
    import sys

    path = embedded.locate_target_gguf()
    assert path.name == embedded.TARGET_GGUF
    assert path.stat().st_size > 50_000_000
    assert embedded.TARGET_PACKAGE not in sys.modules


def test_failed_conversion_leaves_no_folder(tmp_path: Path) -> None:
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"not a gguf file")
    destination = tmp_path / "cache" / "model"
    with pytest.raises(Exception):  # noqa: B017 - whatever the parser raises, nothing may be left
        embedded.convert_gguf(bogus, destination)
    assert not destination.exists()
    assert list((tmp_path / "cache").iterdir()) == []


def fake_model_dir(folder: Path) -> None:
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text(name)


def test_existing_cache_is_reused_untouched(tmp_path: Path) -> None:
    fake_model_dir(tmp_path / embedded.TARGET_DIRNAME)
    models = embedded.prepare_embedded(tmp_path, shipped=False)
    assert models.target == tmp_path / embedded.TARGET_DIRNAME
    assert (models.target / "config.json").read_text() == "config.json"
    if embedded.shipped_draft() is None:
        assert (models.draft, models.draft_quantization) == (models.target, "q8_0")
    else:
        assert (models.draft, models.draft_quantization) == (embedded.SHIPPED_DRAFT, None)
    assert models.dtype == "bfloat16"
    own = embedded.with_target_draft(models, tmp_path)
    assert (own.target, own.draft, own.draft_quantization) == (models.target, models.target, "q8_0")


def test_the_default_target_is_the_gguf_as_shipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No conversion: the shipped file itself, its metadata cached once; the bf16 folder is
    made only where float weights are asked for."""
    monkeypatch.setenv("MULTIGUESS_CACHE_DIR", str(tmp_path))
    models = embedded.prepare_embedded()
    assert models.target == embedded.locate_target_gguf()
    assert not (tmp_path / embedded.TARGET_DIRNAME).exists()
    (folder,) = (tmp_path / "gguf").iterdir()
    assert (folder / "tokenizer.json").is_file()
    # An image caches it as root and serves it as uid 10001: everything reads for all.
    assert folder.stat().st_mode & 0o555 == 0o555
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in folder.iterdir())


@pytest.mark.slow
def test_the_embedded_target_is_q4_1_on_cpus_and_bf16_when_asked() -> None:
    from multiguess.engine.quantized import QuantizedLinear
    from multiguess.llm import load_target

    shipped, pair, dtype = load_target(None, "auto", "cpu")
    down = shipped.model.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantizedLinear) and down.kind == "q4_1"
    assert pair is not None and pair.target.suffix == ".gguf" and dtype == "bfloat16"
    floats, pair, _ = load_target(None, "auto", "cpu", quantization="none")
    assert type(floats.model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert pair is not None and pair.target.name == embedded.TARGET_DIRNAME
    assert floats.dtype == torch.bfloat16


def test_a_pod_finds_the_baked_pair_behind_its_cache_volume(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The operator mounts a cache volume (MULTIGUESS_CACHE_DIR) over an image that baked the
    embedded pair and the kernels read-only (MULTIGUESS_CACHE): both are found, nothing is
    converted again, and new files would go to the volume."""
    monkeypatch.setenv("MULTIGUESS_CACHE_DIR", str(tmp_path / "volume"))
    monkeypatch.setenv("MULTIGUESS_CACHE", str(tmp_path / "baked"))
    assert cache_dirs.cache_roots() == [tmp_path / "volume", tmp_path / "baked"]
    assert cache_dirs.cache_roots()[0] == tmp_path / "volume"
    fake_model_dir(tmp_path / "baked" / embedded.TARGET_DIRNAME)
    assert embedded.prepare_target() == tmp_path / "baked" / embedded.TARGET_DIRNAME
    assert not (tmp_path / "volume").exists()

    from multiguess.engine.backends.cpu import bf16_kernel

    built = bf16_kernel.compiled_path("avx2")
    assert built.parent == tmp_path / "volume" / "kernels"
    baked = tmp_path / "baked" / "kernels" / built.name
    baked.parent.mkdir(parents=True)
    baked.write_bytes(b"")
    assert bf16_kernel.compiled_path("avx2") == baked


def test_incomplete_folder_is_not_a_draft(tmp_path: Path) -> None:
    assert embedded.shipped_draft(tmp_path) is None
    fake_model_dir(tmp_path / "d")
    assert embedded.shipped_draft(tmp_path / "d") == tmp_path / "d"


@pytest.mark.slow
def test_real_conversion_then_cli_reports_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoConfig, AutoTokenizer

    assert cli.main(["embedded", "--cache", str(tmp_path)]) == 0
    reported = json.loads(capsys.readouterr().out)
    assert reported["target"] == str(embedded.locate_target_gguf())
    target = Path(reported["target_bf16"])
    assert target == tmp_path / embedded.TARGET_DIRNAME
    assert embedded.is_complete_model_dir(target)
    config = AutoConfig.from_pretrained(target)
    assert (config.model_type, config.vocab_size, config.num_hidden_layers) == ("llama", 49152, 30)
    tokenizer = AutoTokenizer.from_pretrained(target)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in chat
    # The image bakes this folder as root and serves it as uid 10001: every file reads for all.
    assert {f.name: f.stat().st_mode & 0o444 for f in target.iterdir()} == {
        f.name: 0o444 for f in target.iterdir()
    }
    weights = (target / "model.safetensors").stat().st_mtime_ns
    assert cli.main(["embedded", "--cache", str(tmp_path)]) == 0
    assert (target / "model.safetensors").stat().st_mtime_ns == weights
    assert json.loads(capsys.readouterr().out) == reported


@pytest.mark.skipif(
    embedded.shipped_draft() is None, reason="no trained draft shipped in multiguess/data/draft"
)
def test_shipped_draft_meets_the_draft_contract() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = embedded.SHIPPED_DRAFT
    weights = folder / "model.safetensors"
    assert weights.stat().st_size < 50 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["dtype"]) == ("llama", 49152, "bfloat16")
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    provenance = json.loads((folder / "provenance.json").read_text())
    assert provenance["command"].startswith("multiguess distill")
    metrics = json.loads((folder / "eval.json").read_text())
    assert 0 < metrics["acceptance"] <= metrics["top4_coverage"] <= 1 and 0 < metrics["cost_ratio"] < 1
    assert metrics == provenance["metrics"]
    assert "## Reproduce" in (folder / "PROVENANCE.md").read_text()
    draft = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    assert draft(input_ids=ids).logits.shape == (1, ids.shape[1], 49152)
