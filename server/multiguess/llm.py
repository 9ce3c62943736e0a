"""The offline Python API: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence as Seq
from dataclasses import MISSING, Field, asdict, fields, replace
from typing import TYPE_CHECKING, Any

from multiguess.drafting import DraftOptions, Serving, build_drafter, check_drafter, load_draft_model
from multiguess.engine.config import EngineConfig, ModelConfig, split_options
from multiguess.engine.engine import Engine
from multiguess.engine.loaded_model import LoadedModel
from multiguess.models.loading import load_model, resolve_device
from multiguess.outputs import CompletionOutput, RequestOutput
from multiguess.params import SamplingParams

if TYPE_CHECKING:
    from multiguess.models.embedded import EmbeddedModels

Prompt = str | list[int]


def load_target(
    target: str | None, dtype: str, device: str, quantization: str = "auto"
) -> tuple[LoadedModel, EmbeddedModels | None, str]:
    """The target (``None``: the embedded pair's), the embedded pair when it is that one, and
    the dtype setting its drafts follow (``auto`` is the embedded pair's own dtype). The
    embedded target is its shipped GGUF where ``quantization`` is ``auto`` on a CPU, else its
    bf16 weights (quantized again where ``quantization`` names a format)."""
    embedded = None
    if target is None:
        from multiguess.models.embedded import prepare_embedded

        shipped = quantization == "auto" and resolve_device(device).startswith("cpu")
        embedded = prepare_embedded(shipped=shipped)
        target = str(embedded.target)
        dtype = embedded.dtype if dtype == "auto" else dtype
    return load_model(target, dtype=dtype, device=device, quantization=quantization), embedded, dtype


def load_pair(
    target: str | None,
    draft: str | None,
    dtype: str,
    device: str,
    draft_device: str | None,
    draft_quantization: str | None,
    speculate: bool = True,
    draft_dtype: str | None = None,
    quantization: str = "auto",
) -> tuple[LoadedModel, LoadedModel | None]:
    """Load target and draft model; ``target=None`` means the embedded default pair.

    ``speculate=False`` loads no draft model at all. ``draft_dtype`` None is the target's
    ``dtype`` setting; ``auto`` is resolved on each model's own device (a V100 draft beside an
    A100 target: fp16 and bf16). ``quantization`` is the target's (``load_model``).
    """
    target_model, embedded, dtype = load_target(target, dtype, device, quantization)
    if not speculate:
        return target_model, None
    options = DraftOptions(draft, draft_dtype or dtype, draft_device or device, draft_quantization, embedded)
    return target_model, load_draft_model(target_model, options)


def build_engine(
    config: EngineConfig,
    target: str | None = None,
    draft: str | None = None,
    drafter: str = "auto",
    dtype: str = "auto",
    device: str = "auto",
    draft_device: str | None = None,
    draft_quantization: str | None = None,
    draft_dtype: str | None = None,
    quantization: str = "auto",
    serving: Serving | None = None,
) -> Engine:
    """An engine with the chosen drafter (``drafting.KINDS``): ``auto`` (the default: the draft
    model, or copy drafts alone beside the embedded pair's quantized target), a draft ``model``,
    an ``eagle3`` head (``draft`` is its folder; the embedded target's shipped head by default),
    ``ngram`` lookup, ``suffix`` (copy drafts alone: the sequence's own text and recent outputs,
    ``engine/suffix.py``), or ``none``; ``serving``: a server's (``drafting.Serving``)."""
    check_drafter(drafter)
    target_model, embedded, dtype = load_target(target, dtype, device, quantization)
    options = DraftOptions(
        draft, draft_dtype or dtype, draft_device or device, draft_quantization, embedded, serving=serving
    )
    return Engine(target_model, build_drafter(drafter, target_model, options), config)


def parameters() -> list[inspect.Parameter]:
    """``LLM()``'s parameters, made from the configuration's fields: ``target`` and ``draft``, then
    every ``EngineConfig`` field (the tree budget first, as ``EngineConfig`` takes them), by
    position or keyword, then ``ModelConfig``'s other fields, by keyword."""
    model = {f.name: f for f in fields(ModelConfig)}
    positional = [model.pop("target"), model.pop("draft"), *fields(EngineConfig)]

    def parameter(f: Field[Any], kind: inspect._ParameterKind) -> inspect.Parameter:
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        return inspect.Parameter(f.name, kind, default=default, annotation=f.type)

    return [parameter(f, inspect.Parameter.POSITIONAL_OR_KEYWORD) for f in positional] + [
        parameter(f, inspect.Parameter.KEYWORD_ONLY) for f in model.values()
    ]


class LLM:
    """A target, an optional draft, and the engine that serves them.

    Its parameters are the fields of ``ModelConfig`` and ``EngineConfig`` (``engine/config.py``
    says what each does and its default), so ``LLM(target, draft, num_candidates, depth,
    dtype="float32")`` sets those fields and leaves the others at their defaults.

    ``LLM()`` uses the embedded default pair: on a CPU its Q4_1 target with copy drafts alone
    (``drafter="auto"``), elsewhere its draft model too. ``draft=None`` (with an explicit target) or
    ``drafter="none"`` is plain decoding through the same engine; ``drafter="ngram"`` drafts
    from the sequence itself, with no draft model, and ``drafter="suffix"`` copies alone.
    ``serving`` (a server's, ``drafting.Serving``): the drafter runs inside the guard, or remotely.
    """

    SIGNATURE = inspect.Signature(parameters())

    def __init__(self, *args: Any, serving: Serving | None = None, **options: Any) -> None:
        model, config = split_options(self.SIGNATURE.bind(*args, **options).arguments)
        self.engine = build_engine(config, **asdict(model), serving=serving)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # help(LLM) lists them
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *SIGNATURE.parameters.values()]
    )

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); all of them run as one batch."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params.structured_outputs is not None:  # a grammar that cannot be followed raises
            self.engine.grammars.check(params.structured_outputs)
        results = []
        samples = {}
        try:
            for prompt in prompts:
                ids = self.encode(prompt)
                rid = str(next(self._ids))
                result = RequestOutput(rid, ids, [])
                for i in range(params.n):
                    seed = None if params.seed is None else params.seed + i
                    seq = self.engine.add_request(f"{rid}-{i}", ids, replace(params, seed=seed, n=1))
                    samples[seq.request_id] = (result, i, seq)
                results.append(result)
        except Exception:
            for request_id in samples:  # a bad prompt fails the call, not the engine
                self.engine.abort(request_id)
            raise
        while self.engine.has_unfinished():
            self.engine.step()
        for result, index, seq in samples.values():
            if index == 0 and params.prompt_logprobs is not None:
                result.prompt_logprobs = [None, *seq.prompt_logprobs]
            result.outputs.append(
                CompletionOutput(
                    index,
                    seq.text,
                    seq.output_ids,
                    seq.finish_reason,
                    seq.stats.as_dict(),
                    seq.logprobs if seq.params.logprobs is not None else None,
                    seq.error,
                )
            )
        return results
