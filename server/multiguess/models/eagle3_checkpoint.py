"""EAGLE-3 heads on disk, in the layout the ecosystem publishes and reads.

A head is a folder with ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``, the
head's Llama shape, ``vocab_size`` of the target, ``draft_vocab_size``, optionally
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``) and weights
(``model.safetensors`` or ``pytorch_model.bin``): ``midlayer.*``, ``fc.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t`` (draft id -> offset to its target id), ``t2d``
(a bool mask over the target's vocabulary) and, in some heads, ``embed_tokens.weight`` (else
the target's embeddings are used). SGLang, vLLM and SpecForge read and write these names.

A head only makes sense on the target it was trained for; ``check_target`` refuses one whose
vocabulary, hidden size or feature layers do not fit.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from multiguess.engine.drafters.eagle3 import Eagle3Drafter
from multiguess.engine.eagle3_head import Eagle3Config, Eagle3Head, default_aux_layers
from multiguess.engine.loaded_model import LoadedModel
from multiguess.errors import IncompatibleDraftError, ModelLoadError

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
SHIPPED_HEAD = Path(__file__).resolve().parent.parent / "data" / "eagle3"  # the embedded target's
SHAPE_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "hidden_act",
)


def is_eagle3_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a config naming the EAGLE-3 architecture."""
    path = Path(folder) / "config.json"
    try:
        return ARCHITECTURE in json.loads(path.read_text()).get("architectures", [])
    except (OSError, ValueError, AttributeError):
        return False


def embedded_head() -> Path:
    """The head shipped for the embedded target."""
    if not is_eagle3_folder(SHIPPED_HEAD):
        raise ModelLoadError(
            "no EAGLE-3 head ships for the embedded target: train one with "
            "`multiguess distill --method eagle3` and pass its folder with --draft"
        )
    return SHIPPED_HEAD


def config_from_dict(raw: dict, source: str = "config.json") -> Eagle3Config:
    """The head's ``Eagle3Config`` from a ``LlamaForCausalLMEagle3`` config."""
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise ModelLoadError(
            f"{source}: not an EAGLE-3 head (architectures {raw.get('architectures')!r}, "
            f"expected [{ARCHITECTURE!r}])"
        )
    if raw.get("num_hidden_layers", 1) != 1:
        raise ModelLoadError(
            f"{source}: EAGLE-3 heads with {raw['num_hidden_layers']} layers are not supported"
        )
    try:
        hidden, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
        layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return Eagle3Config(
            hidden_size=hidden,
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            aux_layers=tuple(int(i) for i in layers) if layers else (),
            head_dim=raw.get("head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            hidden_act=raw.get("hidden_act", "silu"),
            extra={k: v for k, v in raw.items() if k not in SHAPE_KEYS},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: incomplete EAGLE-3 config ({exc!r})") from exc


def config_to_dict(config: Eagle3Config, dtype: torch.dtype) -> dict:
    raw = dict(config.extra)
    raw |= {key: getattr(config, key) for key in SHAPE_KEYS if getattr(config, key) is not None}
    raw |= {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {
            **raw.get("eagle_config", {}),
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
        },
    }
    return raw


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head, with a leading ``model.`` dropped (both spellings are published)."""
    if (folder / WEIGHTS).is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / WEIGHTS))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{folder}: no {WEIGHTS} or pytorch_model.bin")
    return {name.removeprefix("model."): tensor for name, tensor in state.items()}


def load_head(
    folder: str | Path, target_config: object, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[Eagle3Head, nn.Embedding | None]:
    """The head in ``folder`` for a target with ``target_config``, and its own embeddings when it
    ships them (None: it reads the target's). Refuses a head made for another target."""
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the EAGLE-3 config in {folder}: {exc}") from exc
    config = config_from_dict(raw, str(folder / "config.json"))
    if not config.aux_layers:
        config = replace(config, aux_layers=default_aux_layers(target_config.num_hidden_layers))
    state = read_weights(folder)
    embed_weight = state.pop("embed_tokens.weight", None)
    check_target(config, target_config, embed_weight is not None, str(folder))
    head = Eagle3Head(config)
    vocabulary_maps(state, config, str(folder))
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(f"{folder}: EAGLE-3 weights missing {missing} / unexpected {unexpected}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ModelLoadError(
                f"{folder}: {name} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[name].shape)}"
            )
    head.load_state_dict(state)
    head.to(device=device, dtype=dtype).eval()  # the integer maps keep their types
    embed = None
    if embed_weight is not None:
        if embed_weight.shape != (config.vocab_size, config.hidden_size):
            raise ModelLoadError(f"{folder}: embed_tokens.weight has shape {tuple(embed_weight.shape)}")
        embed = nn.Embedding.from_pretrained(embed_weight.to(device=device, dtype=dtype), freeze=True)
    return head, embed


def vocabulary_maps(state: dict[str, torch.Tensor], config: Eagle3Config, source: str) -> None:
    """Fill in ``d2t``/``t2d`` where a head leaves them out (a full-vocabulary head maps every id
    to itself) and check that they agree and stay inside the target's vocabulary."""
    draft, vocab = config.draft_vocab_size, config.vocab_size
    if "d2t" not in state:
        if draft != vocab:
            raise ModelLoadError(f"{source}: draft_vocab_size {draft} < vocab_size {vocab} needs a d2t map")
        state["d2t"] = torch.zeros(draft, dtype=torch.long)
    d2t = state["d2t"].long()
    if d2t.shape != (draft,):
        raise ModelLoadError(f"{source}: d2t has shape {tuple(d2t.shape)}, expected ({draft},)")
    targets = torch.arange(draft) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= vocab or len(targets.unique()) != draft:
        raise ModelLoadError(f"{source}: d2t maps draft ids outside [0, {vocab}) or two onto one token")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    if "t2d" in state and not torch.equal(state["t2d"].bool(), t2d):
        raise ModelLoadError(f"{source}: t2d does not mark exactly the tokens d2t maps to")
    state["d2t"], state["t2d"] = d2t, t2d


def check_target(config: Eagle3Config, target_config: object, own_embeddings: bool, source: str) -> None:
    """Refuse a head trained for another target: its features and token ids would mean other things."""
    vocab = target_config.vocab_size
    hidden = target_config.hidden_size
    layers = target_config.num_hidden_layers
    problems = []
    if config.vocab_size != vocab:
        problems.append(f"vocabulary {config.vocab_size} (target: {vocab})")
    if config.target_hidden_size != hidden:
        problems.append(f"target hidden size {config.target_hidden_size} (target: {hidden})")
    if not own_embeddings and config.hidden_size != hidden:
        problems.append(f"hidden size {config.hidden_size} without its own embeddings (target: {hidden})")
    if any(not 0 <= i < layers for i in config.aux_layers):
        problems.append(f"feature layers {list(config.aux_layers)} (target has {layers} layers)")
    if problems:
        raise IncompatibleDraftError(
            f"the EAGLE-3 head in {source} was made for another target: " + "; ".join(problems)
        )


def save_head(head: Eagle3Head, folder: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``head`` in the ``LlamaForCausalLMEagle3`` layout, atomically (a staging folder
    renamed into place)."""
    from safetensors.torch import save_file

    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state = {
        name: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
        for name, t in head.state_dict().items()
    }
    save_file(state, str(staging / WEIGHTS), metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(config_to_dict(head.config, dtype), indent=2) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(staging, folder)


def head_drafter(folder: str | Path, target: LoadedModel) -> Eagle3Drafter:
    """The EAGLE-3 head in ``folder`` drafting for ``target`` (on its device, in its dtype),
    reading the target's embeddings unless the head ships its own."""
    head, embed = load_head(folder, target.model.config, target.dtype, target.device)
    return Eagle3Drafter(head, embed or target.model.model.embed_tokens)
