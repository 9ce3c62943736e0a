"""What ``LLM.generate`` returns (shaped like vLLM's offline outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from multiguess.engine.logprobs import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict[str, float] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token, when ``SamplingParams.logprobs`` asks
    # finish_reason "error": why the grammar matcher failed; the text stops before the failure
    # and does not complete the grammar.
    error: str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(r.logprob for r in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # With ``SamplingParams.prompt_logprobs``: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def stats(self) -> dict[str, float]:
        return self.outputs[0].stats
