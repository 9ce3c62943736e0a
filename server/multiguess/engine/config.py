"""The configuration, from the CLI and the Python API down to the engine: ``ModelConfig`` (what
to load) and ``EngineConfig`` (how the engine runs), each option written once, as a field with
its default and, where the CLI sets it, its flag and help (``flags.option``). ``LLM()``'s
parameters and the engine flags of ``generate``, ``serve`` and ``bench`` are made from these
fields. Importable without torch (the CLI builds its help from it), hence the imports inside
functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from multiguess.engine.admission import request_share
from multiguess.engine.memory_plan import DEFAULT_GPU_MEMORY_UTILIZATION, check_utilization
from multiguess.flags import option
from multiguess.options import DRAFTERS, DTYPE_NAMES, QUANTIZATIONS

if TYPE_CHECKING:
    from multiguess.engine.adaptive import AdaptivePolicy
    from multiguess.engine.drafter import TreeBudget

# ``max_prefill_tokens="auto"``: the largest chunk whose forward takes at most this many
# one-token (decode) forwards, so a running stream waits about that long for a chunk.
PREFILL_PAUSE_STEPS = 8
# Chunks of that size a step prefills while no sequence decodes: no stream waits on the forward,
# so fewer, longer chunks spare a pass over the weights each (a request arriving meanwhile waits
# for one such forward at most, and for the earlier prompts' prefill in any case).
IDLE_PREFILL_CHUNKS = 8


def prefill_tokens(text: str) -> int | str | None:
    """``auto`` or a count of tokens (0: each prompt whole, None); argparse reports the
    ValueError as a bad value."""
    if text == "auto":
        return text
    count = int(text)
    if count < 0:
        raise ValueError(f"--max-prefill-tokens must be auto or >= 0, got {count}")
    return count or None


def utilization(text: str) -> float:
    """A share in (0, 1]; argparse reports the ValueError as a bad flag value."""
    return check_utilization(float(text))


def default_policy() -> AdaptivePolicy:
    from multiguess.engine.adaptive import AdaptivePolicy

    return AdaptivePolicy()


@dataclass(frozen=True)
class ModelConfig:
    """The target, the drafter and its draft, and how each is loaded (``llm.load_pair``).

    ``target`` None is the embedded default pair. ``draft_dtype`` None follows ``dtype``;
    ``auto`` resolves on each model's own device. ``quantization`` is the target's; ``auto``
    serves a checkpoint as it is stored, so the embedded target runs its Q4_1 file on CPUs.
    """

    target: str | None = option(None, "target model folder, hub id or GGUF file (default: embedded pair)")
    draft: str | None = option(None, "draft model folder or hub id (default: embedded draft)")
    quantization: str = option(
        "auto",
        "the target's weights: auto keeps them as the checkpoint stores them (a GGUF's blocks on "
        "CPUs; the embedded target's Q4_1 file on CPUs, its bf16 conversion on GPUs); none: float "
        "(a GGUF dequantized); q8_0, q4_0, q4_1, q4_k, q6_k: GGUF blocks (CPUs); int8: q8_0",
        choices=QUANTIZATIONS,
    )
    draft_quantization: str | None = option(
        None, "the draft's weights, as --quantization (default: auto)", choices=QUANTIZATIONS
    )
    drafter: str = option(
        "auto",
        "auto (the embedded pair's Q4_1 target: suffix; otherwise: model), draft model, EAGLE-3 "
        "head on the target's features (--draft: its folder), n-gram lookup, suffix (copy drafts "
        "from the request and recent outputs alone), or none",
        choices=DRAFTERS,
    )
    dtype: str = option("auto", "weights/activations dtype", choices=DTYPE_NAMES)
    draft_dtype: str | None = option(
        None, "the draft's dtype (default: --dtype's setting)", choices=DTYPE_NAMES
    )
    device: str = option("auto", "target device (auto, cpu, cuda, cuda:1)")
    draft_device: str | None = option(None, "draft device (default: the target's)")


@dataclass(frozen=True)
class EngineConfig:
    """Tree budget (the most a sequence drafts), batch and context limits, adaptivity.

    With ``adaptive`` on, each step's tree follows the draft's measured acceptance and the batch
    size (see ``AdaptivePolicy``), never above the budget; off, every tree uses the budget.
    ``eager`` runs plain PyTorch kernels (no prepacked weights): the escape hatch.
    ``backend`` names the runners' device-family backend (``engine/backends``; auto: the device's).
    ``cuda_graphs`` replays captured decode and verification forwards on GPUs (opt-in until the
    GPU check has shown them identical to eager and faster on a real GPU).
    ``draft_vocab`` lets a draft score only its own vocabulary when it ships one
    (``models/draft_vocab.py``); off, it scores every token.
    ``max_model_len`` None is the target config's own limit (see ``memory_plan``); on GPUs
    ``max_batch`` is cut to the sequences whose KV caches fit in ``gpu_memory_utilization`` of
    the device (``memory_probe.fit_to_memory``).
    ``max_prefill_tokens`` caps the prompt tokens prefilled per step (chunked prefill), so a
    long prompt does not stall the running sequences' tokens; ``auto`` measures the largest
    chunk whose forward stays within ``PREFILL_PAUSE_STEPS`` decode forwards
    (``measure_prefill_chunk``) and prefills ``IDLE_PREFILL_CHUNKS`` of them a step while no
    sequence decodes; None prefills each prompt whole.
    ``max_request_slots`` caps the batch slots one request's samples (its group) hold at once;
    None: half the batch (``admission.request_share``).
    ``prefix_caching`` starts a new prompt from the KV of the longest prefix it shares with a
    finished or running sequence, for target and draft (``engine/prefix_cache.py``).
    ``prompt_lookup`` is the longest copy draft (``engine/suffix.py``: the continuation of the
    sequence's suffix where it occurred before, in its own text or in recent outputs) grafted
    onto a sequence's tree, in tokens, where it pays (0: none; ``Planner._graft_copies`` says where).
    ``recent_outputs`` and ``recent_age`` bound the index of recent outputs copy drafts read
    (tokens, seconds; 0 tokens: none).
    ``kv_blocks`` sizes a paged KV cache's pool (``engine/paged_kv.py``), per model, as vLLM's
    ``num_gpu_blocks_override``; None: every sequence's whole capacity. Where fewer blocks hold
    more sequences than fit at full length, running sequences are preempted and computed again
    when blocks run out (``Engine._make_room``). Static caches ignore it.
    """

    num_candidates: int = option(3, "children per expanded node (1 = chain)", parse=int)
    depth: int = option(4, "levels drafted per step", parse=int)
    max_nodes: int = option(16, "drafted nodes per tree at most", parse=int)
    max_batch: int = option(8, "sequences decoded together at most", parse=int)
    max_model_len: int | None = option(
        None,
        "context length (prompt + output); default and upper bound: the target's config",
        parse=int,
    )
    adaptive: bool = option(True, "always draft the full tree budget", name="--no-adaptive", form="off")
    policy: AdaptivePolicy = field(default_factory=default_policy)
    eager: bool = option(False, "plain PyTorch kernels, no prepacked CPU weights (escape hatch)", form="on")
    backend: str = "auto"
    cuda_graphs: bool = option(False, "replay captured decode/verify forwards on GPUs (opt-in)", form="on")
    draft_vocab: bool = option(
        True,
        "the draft scores every token, not only its draft_vocab.json",
        name="--full-draft-vocab",
        form="off",
    )
    gpu_memory_utilization: float = option(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        "share of each GPU's memory for weights, activations and KV caches, in (0, 1]",
        parse=utilization,
    )
    max_prefill_tokens: int | str | None = option(
        "auto",
        "prompt tokens prefilled per step at most (chunked prefill: a long prompt does not "
        "stall running streams); auto: the largest chunk whose forward takes about 8 decode steps, "
        "measured at startup (8 chunks a step while nothing decodes); 0: each prompt whole",
        parse=prefill_tokens,
    )
    max_request_slots: int | None = None
    prefix_caching: bool = option(
        True,
        "start prompts from the KV of a prefix shared with a recent or running request (default "
        "on; the environment turns it off with 0, false or no)",
        name="--enable-prefix-caching",
        form="toggle",
    )
    prompt_lookup: int = option(
        32,
        "longest copy draft in tokens (what followed the text's suffix where it occurred before, "
        "in the request or recent outputs), grafted onto trees where it pays; 0: none",
        parse=int,
    )
    recent_outputs: int = 1 << 16
    recent_age: float = 3600.0
    kv_blocks: int | None = None

    def __post_init__(self) -> None:
        from multiguess.engine.drafter import TreeBudget

        TreeBudget(self.num_candidates, self.depth, self.max_nodes)  # validates
        if self.depth < 1:
            raise ValueError(
                f"depth must be at least 1, got {self.depth} (use drafter 'none' for plain decoding)"
            )
        if self.max_batch < 1 or (self.max_model_len is not None and self.max_model_len < 2):
            raise ValueError("max_batch must be >= 1 and max_model_len >= 2")
        check_utilization(self.gpu_memory_utilization)
        chunk = self.max_prefill_tokens
        if chunk is not None and chunk != "auto" and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"max_prefill_tokens must be 'auto', None or at least 1, got {chunk!r}")
        if self.max_request_slots is not None and self.max_request_slots < 1:
            raise ValueError(f"max_request_slots must be at least 1, got {self.max_request_slots}")
        if self.prompt_lookup < 0:
            raise ValueError(f"prompt_lookup must be >= 0, got {self.prompt_lookup}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError(f"kv_blocks must be at least 1, got {self.kv_blocks}")
        if self.recent_outputs < 0 or self.recent_age < 0:
            raise ValueError("recent_outputs and recent_age must be >= 0")

    @property
    def budget(self) -> TreeBudget:
        from multiguess.engine.drafter import TreeBudget

        return TreeBudget(self.num_candidates, self.depth, self.max_nodes)

    @property
    def request_slots(self) -> int:
        """The most slots one request's samples hold at once."""
        return self.max_request_slots or request_share(self.max_batch)

    @property
    def graph_width(self) -> int:
        """The widest forward CUDA graphs serve: a verification of the largest tree."""
        return self.tree_slack + 1

    @property
    def tree_slack(self) -> int:
        """Cache room past a sequence's end for a tree (and a drafter's level-by-level region),
        copy drafts grafted onto it included."""
        return max(self.budget.slack, self.prompt_lookup + 2)


def split_options(options: Mapping[str, Any]) -> tuple[ModelConfig, EngineConfig]:
    """The two records from one mapping of (some of) their fields' names to values (``LLM()``'s
    arguments); fields not named keep their defaults."""
    model = {f.name for f in fields(ModelConfig)}
    return (
        ModelConfig(**{k: v for k, v in options.items() if k in model}),
        EngineConfig(**{k: v for k, v in options.items() if k not in model}),
    )
