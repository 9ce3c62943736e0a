"""How many sequences' KV caches fit beside the models, as vLLM's ``--gpu-memory-utilization``.

Pure arithmetic over measured numbers (``memory_probe.py`` measures them): each device may use
``utilization × total`` bytes; what other processes (and the CUDA context) hold, the weights of
the models on it and the largest activation peak of one forward (forwards run one at a time)
come off first (CUDA graphs' pool too), and what is left holds KV caches of ``capacity``
tokens per sequence for every model on the device (with CUDA graphs, each sequence's share of
their logits buffer and mask too). The engine decodes at most ``min(max_batch, what fits on every device)``
sequences; a setting under which not one sequence fits is an error before any request.

The context length is the model's to bound: ``max_model_len`` defaults to the config's
``max_position_embeddings`` (capped at ``UNPLANNED_DEFAULT_LEN`` where no memory is planned, so
a CPU's static cache stays the size it always was) and may not exceed it.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ModelMemory:
    """One model as measured on its device: weights, one forward's activation peak, KV bytes per
    cached token (all layers, keys and values), and with CUDA graphs what they hold: their
    memory pool (the activations of the largest captured forward, kept between replays) and,
    per sequence slot, a row of the logits buffer the graphs share and of the mask a replay
    makes over the attended span."""

    name: str
    device: str
    weights: int
    activation_peak: int
    kv_bytes_per_token: int
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


@dataclass(frozen=True)
class MemoryPlan:
    """The planned sequences (KV slots) of ``capacity`` tokens each, and how each device fares."""

    sequences: int
    capacity: int
    max_model_len: int
    utilization: float
    models: tuple[ModelMemory, ...]
    devices: tuple[DevicePlan, ...]

    def kv_bytes(self, model: ModelMemory) -> int:
        return self.sequences * self.capacity * model.kv_bytes_per_token

    def graph_bytes(self, model: ModelMemory) -> int:
        return model.graph_pool + self.sequences * model.graph_bytes_per_sequence

    def lines(self) -> list[str]:
        """One line per model, as the engine logs them at start."""
        by_device = {d.device: d for d in self.devices}
        lines = []
        for model in self.models:
            device = by_device[model.device]
            graphs = f"CUDA graphs {gib(self.graph_bytes(model))}, " if self.graph_bytes(model) else ""
            lines.append(
                f"memory plan: {model.name} on {model.device}: weights {gib(model.weights)}, "
                f"activations {gib(model.activation_peak)}, {graphs}KV {gib(self.kv_bytes(model))} "
                f"({self.sequences} sequences × {self.capacity} tokens = "
                f"{self.sequences * self.capacity} tokens at {model.kv_bytes_per_token} B/token); "
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
    per_sequence = sum(capacity * m.kv_bytes_per_token + m.graph_bytes_per_sequence for m in models)
    fits = max(0, max(0, kv_room) // per_sequence - scratch_slots) if per_sequence else 0
    return DevicePlan(name, memory.total, budget, memory.elsewhere, weights, activations, kv_room, fits)


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
