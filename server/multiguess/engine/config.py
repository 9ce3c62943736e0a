"""The engine's configuration: one frozen record of every option, from the CLI and the Python
API down to the engine, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field

from multiguess.engine.adaptive import AdaptivePolicy
from multiguess.engine.admission import request_share
from multiguess.engine.drafter import TreeBudget
from multiguess.engine.memory_plan import DEFAULT_GPU_MEMORY_UTILIZATION, check_utilization

# ``max_prefill_tokens="auto"``: the largest chunk whose forward takes at most this many
# one-token (decode) forwards, so a running stream waits about that long for a chunk.
PREFILL_PAUSE_STEPS = 8


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
    (``measure_prefill_chunk``); None prefills each prompt whole.
    ``max_request_slots`` caps the batch slots one request's samples (its group) hold at once;
    None: half the batch (``admission.request_share``).
    ``prefix_caching`` starts a new prompt from the KV of the longest prefix it shares with a
    finished or running sequence, for target and draft (``engine/prefix_cache.py``).
    ``prompt_lookup`` is the longest copy draft (``engine/suffix.py``: the continuation of the
    sequence's suffix where it occurred before, in its own text or in recent outputs) grafted
    onto a sequence's tree, in tokens, where it pays (0: none; ``_graft_copies`` says where).
    ``recent_outputs`` and ``recent_age`` bound the index of recent outputs copy drafts read
    (tokens, seconds; 0 tokens: none).
    """

    num_candidates: int = 3
    depth: int = 4
    max_nodes: int = 16
    max_batch: int = 8
    max_model_len: int | None = None
    adaptive: bool = True
    policy: AdaptivePolicy = field(default_factory=AdaptivePolicy)
    eager: bool = False
    backend: str = "auto"
    cuda_graphs: bool = False
    draft_vocab: bool = True
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_prefill_tokens: int | str | None = "auto"
    max_request_slots: int | None = None
    prefix_caching: bool = True
    prompt_lookup: int = 32
    recent_outputs: int = 1 << 16
    recent_age: float = 3600.0

    def __post_init__(self) -> None:
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
        if self.recent_outputs < 0 or self.recent_age < 0:
            raise ValueError("recent_outputs and recent_age must be >= 0")

    @property
    def budget(self) -> TreeBudget:
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
