"""Per-request generation parameters (mirrors vLLM's ``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from multiguess.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``temperature=0`` is greedy: token-identical to plain greedy decoding.

    ``num_candidates``/``depth`` override the engine's tree budget for this request; ``depth=0``
    disables speculation for it. ``stop`` strings end generation and are not returned.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    num_candidates: int | None = None
    depth: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (all(self.stop), "stop strings must not be empty"),
            (
                self.num_candidates is None or self.num_candidates >= 1,
                f"num_candidates must be at least 1, got {self.num_candidates}",
            ),
            (self.depth is None or self.depth >= 0, f"depth must be >= 0, got {self.depth}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
