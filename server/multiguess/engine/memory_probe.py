"""Measures what ``memory_plan`` plans with, and fits an engine's config to the device.

On each planned device (CUDA): the weights of the models on it (each storage counted once, so
a draft sharing the target's weights adds none), the activation peak of the largest forwards
the engine runs (a verification forward of ``max_batch`` trees at the tree slack's width, one
prefill of ``max_model_len`` tokens, and a prompt chunk scored for its log-probabilities) on
short-lived probe runners, what CUDA graphs hold where they run (``graph_memory``), and what
the device holds outside this process's allocator. CPUs are not planned: their caches stay
``max_batch × max_model_len``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch

from multiguess.engine.loaded_model import LoadedModel
from multiguess.engine.logprobs import PROMPT_LOGPROB_ROWS, prompt_logprobs
from multiguess.engine.memory_plan import (
    DeviceMemory,
    Footprint,
    MemoryPlan,
    ModelMemory,
    gib,
    plan_memory,
    resolve_max_model_len,
)
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree
from multiguess.errors import InsufficientMemoryError
from multiguess.params import MAX_LOGPROBS

if TYPE_CHECKING:
    from multiguess.engine.config import EngineConfig

log = logging.getLogger(__name__)


class MemoryMeter(Protocol):
    """A device's memory as the plan needs it."""

    def device_memory(self, device: torch.device) -> DeviceMemory: ...

    def peak(self, device: torch.device, run: Callable[[], object]) -> int:
        """Bytes allocated on ``device`` while ``run`` runs, above what was allocated before."""
        ...


@dataclass(frozen=True)
class DraftMemory:
    """What a model holds on ``device``, as the memory plan measures it: its ``weights`` (a
    storage another model shares counts once) and ``measure``, which returns the activation
    peak of its largest forwards in an engine of a config (its context length resolved), its
    KV bytes per cached token and what its cache blocks and CUDA graphs take (``Footprint``)."""

    device: torch.device
    weights: tuple[torch.nn.Module, ...]
    measure: Callable[[MemoryMeter, EngineConfig], Footprint]


class CudaMeter:
    def device_memory(self, device: torch.device) -> DeviceMemory:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total, max(0, total - free - torch.cuda.memory_reserved(device)))

    def peak(self, device: torch.device, run: Callable[[], object]) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before


def meter_for(device: torch.device) -> MemoryMeter | None:
    """The meter of a device whose memory is planned; None where caches are not planned."""
    return CudaMeter() if device.type == "cuda" else None


def device_name(device: torch.device) -> str:
    """One name per physical device: ``cuda`` and ``cuda:0`` are the same GPU when 0 is current."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def weight_bytes(module: torch.nn.Module, seen: set[int]) -> int:
    """Bytes of ``module``'s parameters and buffers whose storages are not in ``seen`` (updated)."""
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def probe(
    loaded: LoadedModel,
    meter: MemoryMeter,
    slots: int,
    length: int,
    eager: bool,
    head_vocab: torch.Tensor | None,
    backend: str,
    run: Callable[[NativeRunner], object],
) -> tuple[int, int, int]:
    """(activation peak, KV bytes per token, positions per KV block) of ``run`` on a probe
    runner of ``slots`` slots of ``length`` tokens; its cache is allocated before the
    measurement starts."""
    runner = NativeRunner(loaded, slots, length, eager, head_vocab, backend)
    return (
        meter.peak(loaded.device, lambda: run(runner)),
        runner.cache.bytes_per_token,
        runner.cache.block_size,
    )


def measure_forwards(
    loaded: LoadedModel,
    meter: MemoryMeter,
    max_batch: int,
    width: int,
    max_model_len: int,
    eager: bool,
    head_vocab: torch.Tensor | None,
    backend: str,
) -> tuple[int, int, int, int]:
    """(activation peak, KV bytes per token, positions per KV block, verification peak) of
    ``loaded``: the peak is the largest of a verification forward of ``max_batch`` chains of
    ``width`` tokens, a prefill of ``max_model_len - 1`` and a prompt chunk scored for its
    log-probabilities (every position's logits, normalised as ``logprobs.prompt_logprobs`` does)."""
    chain = TokenTree.chain([0] * width)
    prompt = TokenTree.chain([0] * (max_model_len - 1))
    scored = TokenTree.chain([0] * min(PROMPT_LOGPROB_ROWS, max_model_len - 1))

    def verify(runner: NativeRunner) -> None:
        runner.forward_trees(list(range(max_batch)), [0] * max_batch, [chain] * max_batch)

    def prefill(runner: NativeRunner) -> None:
        runner.forward_trees([0], [0], [prompt], last_only=True)
        logits = runner.forward_trees([0], [0], [scored])
        prompt_logprobs(logits[0], list(scored.tokens), MAX_LOGPROBS)

    try:
        verified, per_token, block_size = probe(
            loaded, meter, max_batch, width, eager, head_vocab, backend, verify
        )
        prefilled, _, _ = probe(loaded, meter, 1, len(prompt), eager, head_vocab, backend, prefill)
    except torch.OutOfMemoryError as exc:
        raise InsufficientMemoryError(
            f"{loaded.device}: a verification forward of {max_batch} trees or a prefill of "
            f"{max_model_len} tokens of {loaded.name} does not fit in the memory left after the "
            f"weights; lower --max-batch or --max-model-len ({exc})"
        ) from exc
    return max(verified, prefilled), per_token, block_size, verified


def graph_memory(config: EngineConfig, verified: int, columns: int, capacity: int) -> tuple[int, int]:
    """(pool, bytes per sequence) CUDA graphs hold, where the config runs them: the pool keeps
    the largest captured forward's activations (a verification of the batch's widest trees:
    ``verified``, its measured peak), and each sequence slot has a row of ``graph_width``
    float32 logits over ``columns`` tokens in the shared buffer and of the replay's bool mask
    over the ``capacity``."""
    if not config.cuda_graphs:
        return 0, 0
    return verified, config.graph_width * (columns * 4 + capacity)


def measure_model(
    loaded: LoadedModel, meter: MemoryMeter, config: EngineConfig, head_vocab: torch.Tensor | None = None
) -> Footprint:
    """What ``loaded`` holds in an engine of ``config`` (its context length resolved): its
    forwards' peak and KV (``measure_forwards``), and what CUDA graphs add (``graph_memory``)."""
    assert config.max_model_len is not None
    peak, per_token, block_size, verified = measure_forwards(
        loaded,
        meter,
        config.max_batch,
        config.tree_slack,
        config.max_model_len,
        config.eager,
        head_vocab,
        config.backend,
    )
    columns = loaded.model.config.vocab_size if head_vocab is None else len(head_vocab)
    pool, per_sequence = graph_memory(config, verified, columns, config.max_model_len + config.tree_slack)
    block_size = 0 if config.cuda_graphs else block_size  # graphs index static slots
    return Footprint(peak, per_token, block_size, pool, per_sequence)


def fit_to_memory(
    config: EngineConfig, target: LoadedModel, drafted: DraftMemory | None
) -> tuple[EngineConfig, MemoryPlan | None]:
    """``config`` with its context length resolved against the target's config and, where the
    target or what the drafter holds (``drafted``, its ``Drafter.memory``: a draft model, an
    EAGLE-3 head) is on a planned device, ``max_batch`` cut to the sequences whose caches fit."""
    held = {"target": DraftMemory(target.device, (target.model,), partial(measure_model, target))}
    if drafted is not None:
        held["draft"] = drafted
    meters = {name: meter_for(h.device) for name, h in held.items()}
    planned = {name: (h, meter) for name, h in held.items() if (meter := meters[name]) is not None}
    limit = getattr(target.model.config, "max_position_embeddings", None)
    config = replace(
        config, max_model_len=resolve_max_model_len(config.max_model_len, limit, planned=bool(planned))
    )
    if not planned:
        return config, None
    measured, seen = [], {}
    for name, (h, meter) in planned.items():
        footprint = h.measure(meter, config)
        device = device_name(h.device)
        weights = sum(weight_bytes(module, seen.setdefault(device, set())) for module in h.weights)
        measured.append(ModelMemory(name, device, weights, *footprint))
    devices = {device_name(h.device): meter.device_memory(h.device) for h, meter in planned.values()}
    assert config.max_model_len is not None
    plan = plan_memory(
        measured,
        devices,
        config.gpu_memory_utilization,
        config.max_batch,
        config.max_model_len,
        config.max_model_len + config.tree_slack,
        scratch_slots=1 if config.cuda_graphs else 0,
    )
    for line in plan.lines():
        log.info(line)
    if plan.sequences < config.max_batch:
        log.warning(
            "max_batch %d lowered to %d: the KV caches of more sequences do not fit (%s left for them)",
            config.max_batch,
            plan.sequences,
            gib(min(d.kv_room for d in plan.devices)),
        )
    return replace(config, max_batch=plan.sequences, kv_blocks=config.kv_blocks or plan.kv_blocks), plan
