"""Pure translations between HTTP bodies and the engine: prompts, parameters, results."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from multiguess.api.errors import APIError
from multiguess.api.schemas import (
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    SpecSummary,
    Usage,
)
from multiguess.engine.engine import EngineConfig
from multiguess.engine.sequence import SpecStats
from multiguess.params import SamplingParams
from multiguess.scheduler import Event, Sample

# Below this a temperature is greedy: dividing logits by it would overflow (vLLM does the same).
GREEDY_BELOW = 1e-5


def sampling_params(body: SamplingFields, max_tokens: int, n: int, config: EngineConfig) -> SamplingParams:
    """The engine's parameters for a body; tree overrides may only shrink the server's budget,
    whose KV-cache room was sized for it."""
    for name, value, limit in (
        ("num_candidates", body.num_candidates, config.num_candidates),
        ("depth", body.depth, config.depth),
    ):
        if value is not None and value > limit:
            raise APIError(400, f"{name} must be at most the server's {limit}; got {value}", param=name)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if body.temperature < GREEDY_BELOW and body.temperature >= 0 else body.temperature,
        top_p=body.top_p,
        top_k=0 if body.top_k == -1 else body.top_k,
        seed=body.seed,
        n=n,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        num_candidates=body.num_candidates,
        depth=body.depth,
    )


def completion_prompts(body: CompletionRequest, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def chat_prompt(messages: list[ChatMessage], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The target's own chat template over the messages, ready for the assistant's turn."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    plain = [
        {
            "role": m.role,
            "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or []),
        }
        for m in messages
    ]
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError) as exc:
        raise APIError(
            400, f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from exc
    return tokenizer.encode(text, add_special_tokens=False)


def check_sample_count(prompts: int, n: int, limit: int) -> None:
    """Checked before building samples, so a huge ``n`` costs nothing."""
    if n >= 1 and prompts * n > limit:
        raise APIError(400, f"a request may ask for at most {limit} samples (prompts x n); got {prompts * n}")


def make_samples(prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
    """``n`` samples per prompt (index = prompt * n + i), seeds ``seed + i`` as in ``LLM``."""
    samples = []
    for ids in prompts:
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            samples.append(Sample(ids, replace(params, seed=seed, n=1)))
    return samples


@dataclass
class Outcome:
    """Events of one job folded into per-sample text, token counts and stats."""

    samples: list[Sample]
    n: int = 1  # samples per prompt
    texts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)

    def __post_init__(self) -> None:
        count = len(self.samples)
        self.texts, self.tokens, self.finish_reasons = [""] * count, [0] * count, [None] * count

    def add(self, event: Event) -> None:
        self.texts[event.index] += event.text
        self.tokens[event.index] += len(event.token_ids)
        if event.finished:
            self.finish_reasons[event.index] = event.finish_reason
            for name in ("verify_steps", "draft_tokens", "accepted_tokens", "fallback_steps"):
                setattr(self.stats, name, getattr(self.stats, name) + int(event.stats.get(name, 0)))

    def usage(self) -> Usage:
        """Each distinct prompt counts once, however many samples it has (OpenAI's rule)."""
        prompt = sum(len(s.prompt_ids) for s in self.samples[:: self.n])
        completion = sum(self.tokens)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def summary(self) -> SpecSummary:
        return SpecSummary(**self.stats.as_dict())
