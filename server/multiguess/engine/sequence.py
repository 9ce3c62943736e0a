"""One running sample: its tokens, cache bookkeeping, stop conditions and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from transformers import PreTrainedTokenizerBase

from multiguess.engine.detokenizer import IncrementalText
from multiguess.engine.grammar import GrammarState
from multiguess.engine.logprobs import TokenLogprob
from multiguess.engine.prediction import Alignment
from multiguess.engine.sampling import Generators, Processing
from multiguess.engine.suffix import OwnText
from multiguess.params import SamplingParams

SOURCES = ("model", "copy", "prediction")  # drafting sources, as SpecStats counts them


@dataclass
class SpecStats:
    """What speculation did for a request. Mean accepted length = 1 + accepted / verify steps.

    By source: the drafter's own nodes (``model``: a model, EAGLE-3 or n-gram), copy drafts
    (engine/suffix.py) and drafts that follow the request's prediction; each source's drafted
    and accepted tokens and the verify steps it drafted in, whose mean accepted length is
    1 + its accepted tokens / its steps."""

    verify_steps: int = 0  # target forwards while decoding (each emits at least one token)
    draft_tokens: int = 0  # drafted nodes the target verified
    accepted_tokens: int = 0  # drafted tokens the target accepted
    fallback_steps: int = 0  # steps decoded without the drafter because it failed
    model_draft_tokens: int = 0
    model_accepted_tokens: int = 0
    model_steps: int = 0
    copy_draft_tokens: int = 0
    copy_accepted_tokens: int = 0
    copy_steps: int = 0
    prediction_draft_tokens: int = 0
    prediction_accepted_tokens: int = 0
    prediction_steps: int = 0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    def source_mean_accepted_length(self, source: str) -> float:
        steps = getattr(self, f"{source}_steps")
        return 1.0 + getattr(self, f"{source}_accepted_tokens") / steps if steps else 0.0

    def count(self, source: str, drafted: int, accepted: int) -> None:
        """One verify step in which ``source`` drafted ``drafted`` tokens, ``accepted`` accepted."""
        if drafted:
            for name, value in (("draft_tokens", drafted), ("accepted_tokens", accepted), ("steps", 1)):
                setattr(self, f"{source}_{name}", getattr(self, f"{source}_{name}") + value)

    def as_dict(self) -> dict[str, float]:
        counts = {f.name: getattr(self, f.name) for f in fields(self)}
        by_source = {
            f"{source}_mean_accepted_length": round(self.source_mean_accepted_length(source), 4)
            for source in SOURCES
        }
        return {**counts, "mean_accepted_length": round(self.mean_accepted_length, 4), **by_source}


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generators: Generators | None  # sampled sequences' random streams
    slot: int = -1
    drafted_at: int = -1  # the last engine step it drafted or probed in (probes favour the oldest)
    cache_len: int = 0  # target KV entries: every token but the last (the next tree's root)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, not a prefill
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_text_len: int = 0
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    decoded: IncrementalText = field(default_factory=IncrementalText)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked
    grammar: GrammarState | None = None  # structured output: the grammar after the output
    sent_logprobs: int = 0  # records handed out by ``take_logprobs``
    cut: bool = False  # a stop string ended the text
    error: str | None = None  # why the grammar matcher failed (finish_reason "error")
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., when asked
    prediction: Alignment | None = None  # predicted output tokens (engine/prediction.py)
    own_text: OwnText = field(default_factory=OwnText)  # for copy drafts (engine/suffix.py)
    group: str = ""  # the client request it is a sample of (admission's fair turns)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """The newest token: the next tree's root."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def prefilling(self) -> bool:
        """Whether tokens before the last (the next tree's root) still lack target KV: a new
        prompt's, or a preempted sequence's prompt and output, computed again."""
        return self.cache_len < len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def processing(self) -> Processing:
        """How a sampled sequence's distributions are processed: by the draft drawing its
        children and by acceptance alike."""
        return Processing(self.params.temperature, self.params.top_p, self.params.top_k)

    def stop_ids(self, eos_ids: frozenset[int]) -> frozenset[int]:
        """Tokens that end this sequence: end-of-sequence (unless ignored) and its stop tokens."""
        stops = eos_ids if not self.params.ignore_eos else frozenset()
        return stops | frozenset(self.params.stop_token_ids)

    def append(
        self,
        tokens: list[int],
        eos_ids: frozenset[int],
        tokenizer: PreTrainedTokenizerBase,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """Add accepted tokens (with their log-probabilities, when recorded), stopping at
        max_tokens, an end-of-sequence token, a stop string, or the token that completes the
        sequence's grammar (what follows it in ``tokens`` was drawn past the end). A grammar
        matcher that fails ends the sequence with ``finish_reason`` "error" and ``error``
        saying why, its output the tokens before the failure."""
        stops = self.stop_ids(eos_ids)
        for i, token in enumerate(tokens[: self.remaining]):
            if self.grammar is not None and token not in stops:
                self.grammar.advance(token)
                self.error = self.grammar.error
                if self.error is not None:  # the token is not part of a valid output: dropped
                    self.finish_reason = "error"
                    break
            self.output_ids.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            if token in stops or (self.grammar is not None and self.grammar.finished):
                self.finish_reason = "stop"
                break
        if not self.finished and self.remaining <= 0:
            self.finish_reason = "length"
        self.text = self.decoded.update(tokenizer, self.output_ids, self.finished)
        if self.params.stop:
            self._apply_stop_strings()

    def _apply_stop_strings(self) -> None:
        hits = [i for i in (self.text.find(s, max(0, self.sent_text_len - len(s))) for s in self.params.stop)]
        hits = [i for i in hits if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"
            self.cut = True
            self.error = None  # the stop string came before the token the grammar failed at

    def take_text_delta(self) -> str:
        """New text safe to stream: holds back an unfinished character or a possible stop prefix."""
        visible = self.text
        if not self.finished:
            visible = visible.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in self.params.stop), default=0)
            visible = visible[: max(self.sent_text_len, len(visible) - hold)]
        delta = visible[self.sent_text_len :]
        self.sent_text_len = len(visible)
        return delta

    def take_logprobs(self, tokenizer: PreTrainedTokenizerBase) -> list[TokenLogprob]:
        """The records not handed out yet of the tokens whose text is released (call it after
        ``take_text_delta``). A stop string may end the text inside a token or before tokens
        already generated, so with stop strings the records follow the released text, not the
        tokens; without them every record goes out at once (the only text held back then is an
        unfinished character, whose tokens are generated all the same)."""
        end = len(self.logprobs)
        if self.logprobs and (self.cut or (self.params.stop and not self.finished)):
            end = self.tokens_for(tokenizer, self.sent_text_len)
        records = self.logprobs[self.sent_logprobs : end]
        self.sent_logprobs = max(self.sent_logprobs, end)
        return records

    def tokens_for(self, tokenizer: PreTrainedTokenizerBase, chars: int) -> int:
        """The fewest output tokens whose text holds the text's first ``chars`` characters (a
        token that ends inside a character holds none of it). Searched from the tokens already
        handed out, decoding a prefix of the output per probe."""
        low, high = self.sent_logprobs, len(self.output_ids)
        while low < high:
            mid = (low + high) // 2
            text = tokenizer.decode(self.output_ids[:mid], skip_special_tokens=True)
            if len(text.rstrip("\ufffd")) >= chars:
                high = mid
            else:
                low = mid + 1
        return low
