"""Pure translations between HTTP bodies and the engine: prompts, parameters, results."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from multiguess.api.errors import APIError
from multiguess.api.prompt_text import templated_ids, text_ids
from multiguess.api.schemas import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    PromptTokensDetails,
    SamplingFields,
    SpecSummary,
    TokenLogprobEntry,
    Tool,
    TopLogprob,
    Usage,
)
from multiguess.engine.config import EngineConfig
from multiguess.engine.logprobs import TokenLogprob
from multiguess.engine.sequence import SpecStats
from multiguess.params import SamplingParams
from multiguess.scheduler import Event, Sample

SPEC_COUNTS = tuple(f.name for f in fields(SpecStats))  # summed over a response's samples
# Below this a temperature is greedy: dividing logits by it would overflow (vLLM does the same).
GREEDY_BELOW = 1e-5


def sampling_params(
    body: SamplingFields,
    max_tokens: int,
    n: int,
    config: EngineConfig,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    tenant: str | None = None,
) -> SamplingParams:
    """The engine's parameters for a body; tree overrides may only shrink the server's budget,
    whose KV-cache room was sized for it. ``logprobs``, ``prompt_logprobs``: alternatives to
    record per generated and per prompt token (None: no records). ``tenant`` (the API key's)
    and the body's ``cache_salt`` scope the prefix cache."""
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
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=token_bias(body.logit_bias),
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        tenant=tenant,
        cache_salt=body.cache_salt,
        prediction=None if body.prediction is None else body.prediction.text,
    )


def token_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` keys are token ids written as strings (the schema checks their
    spelling)."""
    return {int(key): value for key, value in (bias or {}).items()}


# OpenAI fields the server declares but cannot honour: (field, whether a value asks for
# something, why not). Each is a 400 naming the field rather than a silently ignored setting.
UNSUPPORTED: list[tuple[str, Any, str]] = [
    ("suffix", lambda v: bool(v), "insertion (a suffix after the completion) is not supported"),
    ("store", lambda v: v is True, "this server does not store completions"),
    ("modalities", lambda v: v not in (None, ["text"]), "only text output is supported"),
    ("audio", lambda v: v is not None, "audio output is not supported"),
    ("functions", lambda v: bool(v), "function calling is not supported"),
    ("function_call", lambda v: v not in (None, "none"), "function calling is not supported"),
    ("reasoning_effort", lambda v: v is not None, "the served model is not a reasoning model"),
    ("verbosity", lambda v: v is not None, "output verbosity is not supported"),
    ("web_search_options", lambda v: v is not None, "web search is not supported"),
]


def refuse_unsupported(body: SamplingFields) -> None:
    for name, asks, why in UNSUPPORTED:
        if name in type(body).model_fields and asks(getattr(body, name)):
            raise APIError(400, f"{name}: {why}", param=name)


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """Alternatives per token a chat request asks for (None: no logprobs)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def completion_options(body: CompletionRequest) -> tuple[int | None, int | None, int]:
    """A completions request's logprobs to record for generated and for prompt tokens (those
    with ``echo``), and its samples per prompt (``best_of``)."""
    best_of = body.n if body.best_of is None else body.best_of
    if best_of < body.n:
        raise APIError(400, f"best_of ({best_of}) must be at least n ({body.n})", param="best_of")
    if best_of > body.n and body.stream:
        raise APIError(
            400, "best_of above n cannot be streamed: the best are known at the end", param="best_of"
        )
    ranked = 0 if best_of > body.n else None  # ranking needs each token's log-probability
    prompt = body.logprobs if body.echo else None
    return (body.logprobs if body.logprobs is not None else ranked), prompt, best_of


def completion_prompts(body: CompletionRequest, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists. Text is text:
    a special-token string in it is ordinary tokens unless ``split_special_tokens`` is false."""
    prompt = body.prompt
    if not prompt and not isinstance(prompt, str):
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]

    def encode(text: str) -> list[int]:
        if body.split_special_tokens:
            return text_ids(tokenizer, text)
        return list(tokenizer.encode(text))

    texts = [prompt] if isinstance(prompt, str) else prompt
    return [encode(p) if isinstance(p, str) else list(p) for p in texts]


def chat_prompt(
    messages: list[ChatMessage], tokenizer: PreTrainedTokenizerBase, tools: list[Tool] | None = None
) -> list[int]:
    """The target's own chat template over the messages (and the tools offered, for templates
    that show them), ready for the assistant's turn. Only the template makes control tokens: a
    special-token string in a message or a tool is ordinary text (``prompt_text``)."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    plain = [
        {
            "role": m.role,
            "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or []),
        }
        | m.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)
        for m in messages
    ]
    offered = [t.model_dump(exclude_none=True) for t in tools] if tools else None

    def render(callers: tuple[list[dict[str, Any]], list[dict[str, Any]] | None]) -> str:
        chat, shown = callers
        return str(
            tokenizer.apply_chat_template(chat, tools=shown, add_generation_prompt=True, tokenize=False)
        )

    try:
        return templated_ids(tokenizer, render, (plain, offered))
    except (TemplateError, ValueError) as exc:
        raise APIError(
            400, f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from exc


def check_sample_count(prompts: int, n: int, limit: int) -> None:
    """Checked before building samples, so a huge ``n`` costs nothing."""
    if n >= 1 and prompts * n > limit:
        raise APIError(400, f"a request may ask for at most {limit} samples (prompts x n); got {prompts * n}")


def token_text(tokenizer: PreTrainedTokenizerBase, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs_body(
    records: list[TokenLogprob], tokenizer: PreTrainedTokenizerBase, top: int
) -> ChatLogprobs:
    """Chat's ``logprobs.content``: each token, its log-probability, bytes and alternatives."""

    def entry(token: int, logprob: float) -> TopLogprob:
        text = token_text(tokenizer, token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = [
        TokenLogprobEntry(
            **entry(r.token, r.logprob).model_dump(), top_logprobs=[entry(t, lp) for t, lp in r.top[:top]]
        )
        for r in records
    ]
    return ChatLogprobs(content=content)


def completion_logprobs_body(
    records: list[TokenLogprob],
    tokenizer: PreTrainedTokenizerBase,
    top: int,
    offset: int,
    first: int | None = None,
) -> CompletionLogprobs:
    """The completions form; ``text_offset`` counts the token strings' lengths from ``offset``
    (where the previous chunk's tokens ended). ``first`` leads the records with no
    log-probability: an echoed prompt's first token, which nothing before it predicts."""
    lead = [] if first is None else [first]
    tokens = [token_text(tokenizer, t) for t in [*lead, *(r.token for r in records)]]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    tops: list[dict[str, float] | None] | None = None
    if top:
        tops = [None] * len(lead) + [{token_text(tokenizer, t): lp for t, lp in r.top[:top]} for r in records]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None] * len(lead) + [r.logprob for r in records],
        top_logprobs=tops,
        text_offset=offsets,
    )


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
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)

    def __post_init__(self) -> None:
        count = len(self.samples)
        self.texts, self.tokens, self.finish_reasons = [""] * count, [0] * count, [None] * count
        self.cached_tokens = [0] * count
        self.logprobs = [[] for _ in range(count)]
        self.prompt_logprobs = [[] for _ in range(count)]

    def add(self, event: Event) -> None:
        self.texts[event.index] += event.text
        self.tokens[event.index] += len(event.token_ids)
        self.logprobs[event.index].extend(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs[event.index] = event.prompt_logprobs
        if event.finished:
            self.finish_reasons[event.index] = event.finish_reason
            self.cached_tokens[event.index] = int(event.stats.get("cached_tokens", 0))
            for name in SPEC_COUNTS:
                setattr(self.stats, name, getattr(self.stats, name) + int(event.stats.get(name, 0)))

    def usage(self) -> Usage:
        """Each distinct prompt counts once, however many samples it has (OpenAI's rule), and so
        do its tokens served from the prefix cache (its first sample's)."""
        prompt = sum(len(s.prompt_ids) for s in self.samples[:: self.n])
        completion = sum(self.tokens)
        cached = PromptTokensDetails(cached_tokens=sum(self.cached_tokens[:: self.n]))
        accepted = self.stats.prediction_accepted_tokens
        predicted = CompletionTokensDetails(
            accepted_prediction_tokens=accepted,
            rejected_prediction_tokens=self.stats.prediction_draft_tokens - accepted,
        )
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=cached,
            completion_tokens_details=predicted,
        )

    def summary(self) -> SpecSummary:
        return SpecSummary(**self.stats.as_dict())

    def best(self, n: int) -> list[int]:
        """For each prompt, the ``n`` of its samples with the highest log-probability per token
        (OpenAI's ``best_of`` rule), best first; every sample when there are ``n``."""
        chosen = []
        for first in range(0, len(self.samples), self.n):
            indices = list(range(first, first + self.n))
            if n < self.n:
                indices.sort(key=lambda i: -sum(r.logprob for r in self.logprobs[i]) / max(1, self.tokens[i]))
            chosen.extend(indices[:n])
        return chosen
