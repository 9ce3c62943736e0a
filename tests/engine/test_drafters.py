"""The drafter registry and the abilities drafters declare (``multiguess.drafting``,
``engine/drafters/base.py``): one module per drafter, every name the CLI offers built by the
registry, and no caller probing a drafter for what it can do."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from multiguess import drafting, options
from multiguess.commands import engine_args, serve_draft
from multiguess.drafting import KINDS, build_drafter
from multiguess.engine.drafters.base import Drafter, StatelessDrafter
from multiguess.engine.drafters.model import ModelDrafter
from multiguess.engine.drafters.suffix import SuffixDrafter
from multiguess.engine.guard import GuardedDrafter
from multiguess.models.embedded import EmbeddedModels
from multiguess.models.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "server" / "multiguess"
ABILITIES = (
    "feature_layers",
    "takes_grafts",
    "copy_only",
    "prefills",
    "prefill_optional",
    "prefill",
    "add_features",
    "degraded",
)


def choices(register: object, flag: str) -> list[str]:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    register(subparsers)  # type: ignore[operator]
    (sub,) = subparsers.choices.values()
    (action,) = [a for a in sub._actions if flag in a.option_strings]
    return list(action.choices)


def test_every_drafter_module_is_a_registry_line() -> None:
    modules = {p.stem for p in (PACKAGE / "engine" / "drafters").glob("*.py")} - {
        "__init__",
        "base",
        "growing",
    }
    assert modules <= {kind.name for kind in KINDS}


def test_the_cli_offers_the_registry() -> None:
    """Every kind of the registry, after ``auto``, the default, which stands for one of them."""
    names = [drafting.AUTO, *(kind.name for kind in KINDS)]
    assert list(options.DRAFTERS) == list(drafting.DRAFTERS) == names
    parser = argparse.ArgumentParser()
    engine_args.add_engine_args(parser)
    (drafter,) = [a for a in parser._actions if "--drafter" in a.option_strings]
    assert list(drafter.choices) == names
    hosted = [kind.name for kind in KINDS if kind.serves_remotely]
    assert choices(serve_draft.register, "--drafter") == hosted == list(options.DRAFT_SERVER_DRAFTERS)


def test_nothing_probes_a_drafter_for_its_abilities() -> None:
    """Abilities are attributes of ``Drafter``: no ``getattr(drafter, "prefill", ...)``."""
    probe = re.compile(r"getattr\([^)]*[\"'](" + "|".join(ABILITIES) + r")[\"']")
    found = [str(f.relative_to(ROOT)) for f in PACKAGE.rglob("*.py") if probe.search(f.read_text())]
    assert found == []


@pytest.mark.parametrize("kind", ["ngram", "suffix", "none"])
def test_model_free_drafters_build_by_name(tiny_llama: Path, kind: str) -> None:
    target = load_model(str(tiny_llama), dtype="float32")
    drafter = build_drafter(kind, target)
    if kind == "none":
        assert drafter is None
        return
    assert isinstance(drafter, StatelessDrafter) and drafter.memory() is None
    guarded = build_drafter(kind, target, drafting.DraftOptions(serving=drafting.Serving()))
    assert isinstance(guarded, GuardedDrafter) and isinstance(guarded.inner, type(drafter))
    abilities = ("takes_grafts", "copy_only", "prefills", "prefill_optional")
    assert [getattr(guarded, a) for a in abilities] == [getattr(drafter, a) for a in abilities]


def test_auto_copies_alone_beside_the_embedded_pairs_quantized_target(
    tiny_llama: Path, tiny_llama_draft: Path
) -> None:
    """``auto`` (the default) drafts with the draft model, except beside the embedded pair's
    quantized target, where the draft model costs more than it brings: there copies alone."""
    embedded = EmbeddedModels(tiny_llama, tiny_llama_draft, None, "float32")
    quantized = load_model(str(tiny_llama), dtype="float32", quantization="q8_0")
    floats = load_model(str(tiny_llama), dtype="float32")
    assert isinstance(
        build_drafter("auto", quantized, drafting.DraftOptions(embedded=embedded)), SuffixDrafter
    )
    assert isinstance(build_drafter("auto", floats, drafting.DraftOptions(embedded=embedded)), ModelDrafter)
    named = drafting.DraftOptions(draft=str(tiny_llama_draft))  # a target and draft of one's own
    assert isinstance(build_drafter("auto", quantized, named), ModelDrafter)
    assert build_drafter("auto", quantized) is None  # a target of one's own without a draft: plain


def test_an_unknown_drafter_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="drafter must be one of auto, model, eagle3, ngram, suffix, none"):
        build_drafter("medusa", load_model(str(tiny_llama), dtype="float32"))


def test_a_drafter_missing_a_call_cannot_be_made() -> None:
    class ProposesOnly(Drafter):
        def propose(self, requests: list) -> list:
            return []

    with pytest.raises(TypeError, match="abstract"):
        ProposesOnly()  # type: ignore[abstract]
