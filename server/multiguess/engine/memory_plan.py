"""How many sequences' KV caches fit beside the models, as vLLM's ``--gpu-memory-utilization``.

Pure arithmetic over measured numbers (``memory_probe.py`` measures them): each device may use
``utilization × total`` bytes; what other processes (and the CUDA context) hold, the weights of
the models on it and the largest activation peak of one forward (forwards run one at a time)
come off first (CUDA graphs' pool too), and what is left holds KV caches of ``capacity``
tokens per sequence for every model on the device (with CUDA graphs, each sequence's share of
their logits buffer and mask too). The engine decodes at most
``min(max_batch, what fits on every device)`` sequences; a setting under which not one sequence
fits is an error before any request. A paged cache (``paged_kv.py``) is planned in its blocks:
each sequence's capacity rounded up to whole blocks: the room left holds that many blocks, which
up to ``max_batch`` sequences take as they grow (a pool holds at least one whole sequence;
running sequences are preempted when it runs out, ``Engine._make_room``), as vLLM plans its
blocks; the plan's line says how many.

The context length is the model's to bound: ``max_model_len`` defaults to the config's
``max_position_embeddings`` (capped at ``UNPLANNED_DEFAULT_LEN`` where no memory is planned, so
a CPU's static cache stays the size it always was) and may not exceed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from multiguess.errors import EngineConfigError, InsufficientMemoryError

# The default context length where no memory plan sizes the caches (CPUs): the static cache is
# max_batch × this, whatever the model's own limit.
UNPLANNED_DEFAULT_LEN = 2048
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def check_utilization(value: float) -> float:
    if not 0 < value <= 1:
        raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {value}")
    return value


def resolve_max_model_len(requested: int | None, model_limit: int | None, planned: bool) -> int:
    """The context length: ``requested``, bounded by the model's ``model_limit``; by default the
    limit itself where memory is planned, else at most ``UNPLANNED_DEFAULT_LEN``."""
    if requested is None:
        if model_limit is None:
            return UNPLANNED_DEFAULT_LEN
        return model_limit if planned else min(model_limit, UNPLANNED_DEFAULT_LEN)
    if requested < 2:
        raise EngineConfigError(f"max_model_len must be at least 2, got {requested}")
    if model_limit is not None and requested > model_limit:
        raise EngineConfigError(
            f"max_model_len {requested} exceeds the model's own limit of {model_limit} tokens "
            f"(max_position_embeddings in its config); use --max-model-len {model_limit} or less"
        )
    return requested


class Footprint(NamedTuple):
    """What one model holds per the measurements of ``memory_probe``: the fields of
    ``ModelMemory`` after its name, device and weights."""

    activation_peak: int
    kv_bytes_per_token: int
    block_size: int = 0
    graph_pool: int = 0
    graph_bytes_per_sequence: int = 0


@dataclass(frozen=True)
class ModelMemory:
    """One model as measured on its device: weights, one forward's activation peak, KV bytes per
    cached token (all layers, keys and values), the positions per block of its KV cache (0:
    static slots, each one block of a whole sequence's capacity), and with CUDA graphs what they
    hold: their memory pool (the activations of the largest captured forward, kept between
    replays) and, per sequence slot, a row of the logits buffer the graphs share and of the mask
    a replay makes over the attended span."""

    name: str
    device: str
    weights: int
    activation_peak: int
    kv_bytes_per_token: int
    block_size: int = 0
    graph_pool: int = 0
    graph_bytes_per_sequence: int = 0


@dataclass(frozen=True)
class DeviceMemory:
    """A device's total memory and what is held on it by others (other processes, the CUDA
    context: everything not in this process's allocator)."""

    total: int
    elsewhere: int


@dataclass(frozen=True)
class DevicePlan:
    device: str
    total: int
    budget: int  # utilization × total
    elsewhere: int
    weights: int
    activations: int
    kv_room: int  # what is left for KV caches
    fits: int  # sequences of ``capacity`` tokens that fit
    blocks: int = 0  # KV blocks that fit, each model's for the same positions (0: no blocks)


@dataclass(frozen=True)
class MemoryPlan:
    """The planned sequences of ``capacity`` tokens each, and how each device fares. Static
    caches hold each sequence's whole capacity; paged ones hold ``kv_blocks`` blocks, which
    running sequences take as they grow (more sequences than fit at full length, preempted
    when blocks run out)."""

    sequences: int
    capacity: int
    max_model_len: int
    utilization: float
    models: tuple[ModelMemory, ...]
    devices: tuple[DevicePlan, ...]
    kv_blocks: int | None = None  # the paged pools' blocks per model (None: static caches)

    def blocks(self, model: ModelMemory) -> tuple[int, int]:
        """(blocks, positions per block) of ``model``'s cache (a static slot is one block)."""
        if self.kv_blocks is not None:
            return self.kv_blocks, model.block_size
        return self.sequences, self.capacity

    def kv_bytes(self, model: ModelMemory) -> int:
        blocks, size = self.blocks(model)
        return blocks * size * model.kv_bytes_per_token

    def shape(self, blocks: int, size: int) -> str:
        if self.kv_blocks is None:
            return f"{self.sequences} sequences × {self.capacity} tokens = {self.sequences * self.capacity} tokens"
        whole = sequence_positions(self.capacity, size) // size
        return (
            f"{blocks} blocks of {size} tokens = {blocks * size} tokens for up to {self.sequences} "
            f"sequences, {whole} blocks each at {self.capacity} tokens"
        )

    def graph_bytes(self, model: ModelMemory) -> int:
        return model.graph_pool + self.sequences * model.graph_bytes_per_sequence

    def lines(self) -> list[str]:
        """One line per model, as the engine logs them at start."""
        by_device = {d.device: d for d in self.devices}
        lines = []
        for model in self.models:
            device = by_device[model.device]
            blocks, size = self.blocks(model)
            graphs = f"CUDA graphs {gib(self.graph_bytes(model))}, " if self.graph_bytes(model) else ""
            lines.append(
                f"memory plan: {model.name} on {model.device}: weights {gib(model.weights)}, "
                f"activations {gib(model.activation_peak)}, {graphs}KV {gib(self.kv_bytes(model))} "
                f"({self.shape(blocks, size)} at {model.kv_bytes_per_token} B/token); "
                f"the device has room for {device.fits} sequences at utilization "
                f"{self.utilization:g} of {gib(device.total)}"
            )
        return lines


def gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"


def plan_memory(
    models: list[ModelMemory],
    devices: dict[str, DeviceMemory],
    utilization: float,
    max_batch: int,
    max_model_len: int,
    capacity: int,
    scratch_slots: int = 0,
) -> MemoryPlan:
    """KV slots for ``models`` (each on one of ``devices``) at ``capacity`` tokens a sequence,
    besides ``scratch_slots`` more of them that hold no sequence (CUDA graphs' padding rows).

    Raises ``InsufficientMemoryError`` when not one sequence fits on some device, saying what
    would: a shorter context, a higher utilization, or less on the device.
    """
    check_utilization(utilization)
    if max_batch < 1:
        raise EngineConfigError(f"max_batch must be at least 1, got {max_batch}")
    plans = []
    for name, memory in devices.items():
        here = [m for m in models if m.device == name]
        plan = device_plan(name, memory, here, utilization, capacity, scratch_slots)
        if plan.fits < 1:
            per_token = sum(m.kv_bytes_per_token for m in here)
            raise InsufficientMemoryError(not_fitting(plan, per_token, capacity, max_model_len, utilization))
        plans.append(plan)
    sizes = {m.block_size for m in models}
    if len(sizes) == 1 and 0 not in sizes:  # paged: up to max_batch sequences share the blocks
        blocks = min(p.blocks for p in plans)
        return MemoryPlan(
            max_batch, capacity, max_model_len, utilization, tuple(models), tuple(plans), blocks
        )
    sequences = min([max_batch, *(p.fits for p in plans)])
    return MemoryPlan(sequences, capacity, max_model_len, utilization, tuple(models), tuple(plans))


def device_plan(
    name: str,
    memory: DeviceMemory,
    models: list[ModelMemory],
    utilization: float,
    capacity: int,
    scratch_slots: int = 0,
) -> DevicePlan:
    budget = round(memory.total * utilization)
    weights = sum(m.weights for m in models)
    activations = max((m.activation_peak for m in models), default=0)
    kv_room = budget - memory.elsewhere - weights - activations - sum(m.graph_pool for m in models)
    per_sequence = sum(
        sequence_positions(capacity, m.block_size) * m.kv_bytes_per_token + m.graph_bytes_per_sequence
        for m in models
    )
    fits = max(0, max(0, kv_room) // per_sequence - scratch_slots) if per_sequence else 0
    sizes = {m.block_size for m in models}
    per_block = sum(m.kv_bytes_per_token for m in models) * max(sizes, default=0)
    blocks = max(0, kv_room) // per_block if len(sizes) == 1 and per_block else 0
    return DevicePlan(
        name, memory.total, budget, memory.elsewhere, weights, activations, kv_room, fits, blocks
    )


def sequence_positions(capacity: int, block_size: int) -> int:
    """Cache positions one sequence of ``capacity`` tokens takes: whole blocks (0: no blocks)."""
    return -(-capacity // block_size) * block_size if block_size else capacity


def not_fitting(
    plan: DevicePlan, per_token: int, capacity: int, max_model_len: int, utilization: float
) -> str:
    """What does not fit on ``plan.device`` (``per_token`` KV bytes of all its models, a
    sequence holding ``capacity`` tokens for ``max_model_len``), and the settings that would."""
    used = (
        f"weights {gib(plan.weights)} + activations {gib(plan.activations)} + "
        f"held elsewhere {gib(plan.elsewhere)}"
    )
    head = f"{plan.device}: at gpu_memory_utilization {utilization:g} the budget is {gib(plan.budget)}"
    if plan.kv_room <= 0:
        return (
            f"{head}, and {used} leave no room for a KV cache; raise --gpu-memory-utilization, "
            "free the device, or use a smaller model or dtype"
        )
    longest = plan.kv_room // per_token - (capacity - max_model_len)
    hint = f"--max-model-len {longest} or less, " if longest >= 2 else ""
    return (
        f"{head}; after {used}, {gib(plan.kv_room)} is left, less than one sequence's KV cache of "
        f"{capacity} tokens ({gib(per_token * capacity)} at {per_token} B/token); use {hint}"
        "a higher --gpu-memory-utilization, or put the draft on another device"
    )
