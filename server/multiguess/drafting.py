"""The drafter registry: every ``--drafter`` name, what it needs, and how one is built.

``build_drafter(kind, target, options)`` is the one way a drafter comes to be (the Python API,
``serve``, ``serve-draft``, ``bench`` and the benchmarks call it); the engine receives it
finished, so its memory plan counts what the drafter holds. Importing this module imports no
torch (the CLI builds its help from ``DRAFTERS``): each builder imports its drafter when called.
Adding a drafter is a module in ``engine/drafters/``, a line in ``KINDS`` and its name in
``options.DRAFTERS`` (CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multiguess.remote.hosted import Hosted

if TYPE_CHECKING:
    from multiguess.engine.drafters.base import Drafter
    from multiguess.engine.loaded_model import LoadedModel
    from multiguess.models.embedded import EmbeddedModels


@dataclass(frozen=True)
class Serving:
    """How a server runs its drafter: inside ``GuardedDrafter``, which bounds a step by
    ``step_timeout`` seconds and pauses speculation ``cooldown`` seconds after a failure; with
    ``url``, a draft server (``serve-draft``) drafts instead and decides how, with the
    deployment's ``secret`` and its metrics in ``registry``."""

    step_timeout: float = 2.0
    cooldown: float = 30.0
    url: str | None = None
    secret: bytes | None = None
    registry: Any = None


@dataclass(frozen=True)
class DraftOptions:
    """Where a drafter's weights come from and how they load (the ``--draft*`` flags).

    ``draft``: a draft model's folder or hub id, or an EAGLE-3 head's folder; ``dtype``,
    ``device`` and ``quantization`` the draft model's. ``embedded``: the target is the embedded
    pair's, whose draft model and shipped head are then the drafts. ``loaded``: a draft model
    loaded already (the benchmark shares one among engines). ``serving``: a server's (above).
    ``target``: on a draft server, the target a hosted head reads (its config, tokenizer and
    embeddings; None: the embedded target).
    """

    draft: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    quantization: str | None = None
    embedded: EmbeddedModels | None = None
    loaded: LoadedModel | None = None
    serving: Serving | None = None
    target: str | None = None


Builder = Callable[["LoadedModel", DraftOptions], "Drafter | None"]
HostBuilder = Callable[[DraftOptions], Hosted]


@dataclass(frozen=True)
class DrafterKind:
    """A ``--drafter`` choice: its builder, whether it reads a checkpoint (``--draft``; the
    operator's ``spec.draft``), and, when ``serve-draft`` can host it, the draft server's
    builder (with whether that server reads the target: config, tokenizer and embeddings)."""

    name: str
    build: Builder
    reads_draft: bool = False
    host: HostBuilder | None = None
    server_reads_target: bool = False

    @property
    def serves_remotely(self) -> bool:
        return self.host is not None


def load_draft_model(target: LoadedModel, options: DraftOptions) -> LoadedModel | None:
    """The draft model of ``options`` (the embedded pair's beside the embedded target), checked
    to share the target's tokenizer; None without one."""
    from multiguess.models.loading import check_draft_compatible, load_model

    embedded = options.embedded
    path = str(embedded.draft) if embedded is not None else options.draft
    if path is None:
        return None
    quantization = options.quantization or (embedded.draft_quantization if embedded else None)
    draft = load_model(path, dtype=options.dtype, device=options.device, quantization=quantization or "auto")
    check_draft_compatible(target.tokenizer, draft.tokenizer)
    return draft


def model_drafter(target: LoadedModel, options: DraftOptions) -> Drafter | None:
    """A draft model beside the target (None without one: plain decoding)."""
    from multiguess.engine.drafters.model import ModelDrafter

    draft = options.loaded or load_draft_model(target, options)
    return None if draft is None else ModelDrafter(draft)


def eagle3_drafter(target: LoadedModel, options: DraftOptions) -> Drafter:
    """The EAGLE-3 head in ``options.draft`` (default: the embedded target's shipped head)."""
    from multiguess.models.eagle3_checkpoint import embedded_head, head_drafter

    return head_drafter(options.draft or embedded_head(), target)


def hosted_model(options: DraftOptions) -> Hosted:
    """A draft server's draft model (without ``draft``: the embedded pair's, as ``serve`` uses it)."""
    from multiguess.engine.drafters.model import ModelDrafter
    from multiguess.models.loading import load_model

    draft, quantization, dtype = options.draft, options.quantization, options.dtype
    if draft is None:
        from multiguess.models.embedded import prepare_embedded

        embedded = prepare_embedded()
        draft = str(embedded.draft)
        quantization = quantization or embedded.draft_quantization
        dtype = embedded.dtype if dtype == "auto" else dtype
    loaded = load_model(draft, dtype=dtype, device=options.device, quantization=quantization or "auto")
    return Hosted(ModelDrafter(loaded, wire_exact=True), loaded.name, loaded.tokenizer)


def hosted_eagle3(options: DraftOptions) -> Hosted:
    """A draft server's EAGLE-3 head (default: the embedded target's) for ``options.target``
    (default: the embedded target, whose default dtype it then takes), of which it reads only
    the config, the tokenizer and the token embeddings."""
    from multiguess.engine.drafters.eagle3 import Eagle3Drafter
    from multiguess.models.draft_head import load_draft_head
    from multiguess.models.eagle3_checkpoint import embedded_head

    target, dtype = options.target, options.dtype
    if target is None:
        from multiguess.models.embedded import DEFAULT_DTYPE, prepare_target

        target = str(prepare_target())
        dtype = DEFAULT_DTYPE if dtype == "auto" else dtype
    loaded = load_draft_head(options.draft or str(embedded_head()), target, dtype, options.device)
    return Hosted(Eagle3Drafter(loaded.head, loaded.embed, wire_exact=True), loaded.name, loaded.tokenizer)


def ngram_drafter(target: LoadedModel, options: DraftOptions) -> Drafter:
    from multiguess.engine.drafters.ngram import NgramDrafter

    return NgramDrafter()


def suffix_drafter(target: LoadedModel, options: DraftOptions) -> Drafter:
    from multiguess.engine.drafters.suffix import SuffixDrafter

    return SuffixDrafter()


def no_drafter(target: LoadedModel, options: DraftOptions) -> None:
    """Plain decoding."""
    return None


KINDS = (
    DrafterKind("model", model_drafter, reads_draft=True, host=hosted_model),
    DrafterKind("eagle3", eagle3_drafter, reads_draft=True, host=hosted_eagle3, server_reads_target=True),
    DrafterKind("ngram", ngram_drafter),
    DrafterKind("suffix", suffix_drafter),
    DrafterKind("none", no_drafter),
)
BY_NAME = {kind.name: kind for kind in KINDS}
AUTO = "auto"  # the default choice, which stands for a kind of the registry (``resolve``)
DRAFTERS = (AUTO, *BY_NAME)
DRAFT_SERVER_DRAFTERS = tuple(k.name for k in KINDS if k.serves_remotely)  # what serve-draft can host
READS_DRAFT = (AUTO, *(k.name for k in KINDS if k.reads_draft))  # auto: where it stands for model


def check_drafter(kind: str) -> None:
    if kind not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}; got {kind!r}")


def resolve(kind: str, target: LoadedModel, options: DraftOptions) -> str:
    """The registry's kind ``kind`` stands for: itself, or for ``auto`` (the default) copy drafts
    alone (``suffix``) beside the embedded pair's quantized target (its Q4_1 file on CPUs) and the
    draft model (``model``) otherwise. A draft level takes about as long whatever the target's
    weights, a larger share of the quantized target's faster step: beside the copy sources the
    draft model cost more than it brought there on every grounded workload at batch 1
    (docs/ENGINE.md)."""
    if kind != AUTO:
        return kind
    from multiguess.engine.quantized import linear_formats

    return "suffix" if options.embedded is not None and linear_formats(target.model) else "model"


def build_drafter(kind: str, target: LoadedModel, options: DraftOptions | None = None) -> Drafter | None:
    """The ``kind`` drafter for ``target`` (``resolve``; None: ``none``, or ``model`` without a
    draft); with ``options.serving``, inside the guard, and the draft server's when that names a
    ``url``."""
    check_drafter(kind)
    options = options or DraftOptions()
    kind = resolve(kind, target, options)
    serving = options.serving
    if serving is None:
        return BY_NAME[kind].build(target, options)
    drafter = remote_drafter(target, serving) if serving.url else BY_NAME[kind].build(target, options)
    if drafter is None:
        return None
    from multiguess.engine.guard import GuardedDrafter

    return GuardedDrafter(drafter, target.model.config.vocab_size, serving.step_timeout, serving.cooldown)


def host_drafter(kind: str, options: DraftOptions) -> Hosted:
    """The ``kind`` drafter as ``serve-draft`` hosts it."""
    host = BY_NAME[kind].host if kind in BY_NAME else None
    if host is None:
        raise ValueError(f"serve-draft hosts {', '.join(DRAFT_SERVER_DRAFTERS)}; got {kind!r}")
    return host(options)


def remote_drafter(target: LoadedModel, serving: Serving) -> Drafter:
    """A draft server's drafter, connected now: it learns the head's feature layers before the
    first prompt (a server not up yet is tried again at the first proposal)."""
    from multiguess.remote.client import RemoteDrafter

    assert serving.url is not None
    drafter = RemoteDrafter(
        serving.url,
        target.tokenizer,
        step_timeout=serving.step_timeout,
        registry=serving.registry,
        secret=serving.secret,
        target_config=target.model.config,
    )
    drafter.connect()
    return drafter
