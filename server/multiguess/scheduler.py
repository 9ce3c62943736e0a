"""The asyncio front of the engine: admission, deadlines, cancellation, and one worker thread.

The engine is not thread-safe, so a single worker thread owns it: it loads the models, warms
up, then alternates between applying commands (add, abort, stop) and engine steps. The event
loop never waits on a step; it only exchanges commands and events with the worker.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from multiguess.engine.engine import Engine
from multiguess.engine.logprobs import TokenLogprob
from multiguess.engine.sequence import Sequence
from multiguess.errors import InvalidRequestError
from multiguess.metrics import Metrics
from multiguess.params import SamplingParams

log = logging.getLogger(__name__)


class NotReady(Exception):
    """The server cannot take requests now (loading, failed, or shutting down)."""


class Overloaded(Exception):
    """The waiting queue is full; the client should retry later."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeout(Exception):
    """The request's deadline (queue + generation) passed."""


class EngineFailure(Exception):
    """The engine failed or stopped while the request ran."""


class ShuttingDown(EngineFailure):
    """The shutdown grace period ran out before the request finished."""


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Event:
    """What one engine step produced for one sample; ``stats`` is filled when it finishes."""

    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stats: dict[str, float]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked: of tokens whose text is out
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens after the first, in the first event
    error: str | None = None  # finish_reason "error": why the sample's grammar matcher failed


@dataclass
class Job:
    """A request's samples as the front sees them: events arrive on ``events``."""

    id: str
    samples: list[Sample]
    submitted: float
    deadline: float
    events: asyncio.Queue[Event | Exception] = field(default_factory=asyncio.Queue)
    unfinished: int = 0
    closed: bool = False

    def __post_init__(self) -> None:
        self.unfinished = len(self.samples)

    @property
    def done(self) -> bool:
        return self.unfinished == 0

    async def next_event(self) -> Event:
        """The next event; raises at the deadline or when the engine failed the request."""
        remaining = self.deadline - time.monotonic()
        try:
            item = await asyncio.wait_for(self.events.get(), timeout=max(remaining, 0.0))
        except TimeoutError:
            raise RequestTimeout("the request did not finish within the server's request timeout") from None
        if isinstance(item, Exception):
            raise item
        if item.finished:
            self.unfinished -= 1
        return item


@dataclass
class _Tracked:
    """The worker's view of a job. ``prompt_source[i]``: the sample whose prompt
    log-probabilities sample ``i`` reports (``shared_prompt_logprobs``), kept in ``prompt_records``."""

    job: Job
    sequences: list[Sequence]
    prompt_source: list[int]
    unfinished: int = 0
    admitted: bool = False
    first_token: bool = False
    last_token_at: dict[int, float] = field(default_factory=dict)
    prompt_records: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    opened: set[int] = field(default_factory=set)  # samples whose first event is out

    def prompt_logprobs(self, index: int, own: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
        """What sample ``index``'s event carries: its ``own`` records, or at its first event
        those of the sample that computed them for it."""
        if own is not None:
            self.prompt_records[index] = own
        first = index not in self.opened
        self.opened.add(index)
        source = self.prompt_source[index]
        return own if own is not None or not first or source == index else self.prompt_records.get(source)


_STOP = object()


def shared_prompt_logprobs(samples: list[Sample]) -> tuple[list[Sample], list[int]]:
    """A request's samples with the prompt log-probabilities of each distinct prompt computed
    once: samples repeating an earlier sample's prompt (``n`` > 1) stop asking for them, and
    report that sample's (the returned source of each). The engine then prefills such a prompt
    once too (its later samples start from the first one's KV)."""
    first: dict[tuple[int, ...], int] = {}
    out, sources = [], []
    for i, sample in enumerate(samples):
        source = first.setdefault(tuple(sample.prompt_ids), i)
        asks = sample.params.prompt_logprobs is not None
        if asks and source != i and samples[source].params.prompt_logprobs == sample.params.prompt_logprobs:
            out.append(replace(sample, params=replace(sample.params, prompt_logprobs=None)))
            sources.append(source)
        else:
            out.append(sample)
            sources.append(i)
    return out, sources


def warm_up(engine: Engine) -> None:
    """One short generation, so the first user does not pay for lazy initialisation."""
    ids = engine.tokenizer.encode("Hello") or [0]
    engine.add_request("warmup", ids, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


class Scheduler:
    def __init__(
        self,
        load: Callable[[], Engine],
        metrics: Metrics,
        max_queue: int = 64,
        request_timeout: float = 600.0,
        warmup: bool = True,
    ) -> None:
        if max_queue < 0 or request_timeout <= 0:
            raise ValueError("max_queue must be >= 0 and request_timeout > 0")
        self.metrics = metrics
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.state = "loading"  # loading -> ready -> draining -> stopped; or failed
        self.reason: str | None = None
        self.engine: Engine | None = None
        self._load = load
        self._warmup = warmup
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._in_flight = 0  # samples admitted by the front and not yet released
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="multiguess-engine", daemon=True)
        self._tracked: dict[str, _Tracked] = {}  # worker-only from here on
        self._owner: dict[str, tuple[_Tracked, int]] = {}

    # -- the front (event loop thread) ------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def max_samples(self) -> int:
        """Samples one request may ask for: all must fit the engine's batch at once."""
        return self.engine.config.max_batch if self.engine else 0

    def check_ready(self) -> Engine:
        """The engine, if requests are taken now; else NotReady (counted as a rejection)."""
        if self.state != "ready" or self.engine is None:
            self.metrics.rejected.labels(reason="not_ready").inc()
            raise NotReady(self.not_ready_message())
        return self.engine

    async def submit(self, samples: list[Sample]) -> Job:
        """Admit a request or raise NotReady/Overloaded/InvalidRequestError; then call ``release``."""
        self.check_ready()
        if len(samples) > self.max_samples:
            raise InvalidRequestError(
                f"a request may ask for at most {self.max_samples} samples (prompts x n); got {len(samples)}"
            )
        if self._in_flight + len(samples) > self.max_samples + self.max_queue:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise Overloaded(
                f"the server is at capacity ({self.max_queue} waiting); retry later", retry_after=1
            )
        now = time.monotonic()
        job = Job(f"req-{next(self._ids)}", samples, now, now + self.request_timeout)
        self._in_flight += len(samples)
        added: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(("add", job, added))
        try:
            await asyncio.wrap_future(added)
        except BaseException:
            self.release(job)
            raise
        return job

    def release(self, job: Job) -> None:
        """End a job: aborts whatever it still generates. Idempotent."""
        if job.closed:
            return
        job.closed = True
        self._in_flight -= len(job.samples)
        if not job.done:
            self._commands.put(("abort", job, None))

    @property
    def idle(self) -> bool:
        """No admitted request is still running (a drain can end)."""
        return self._in_flight == 0

    def expire(self, message: str) -> None:
        """End every running request now with ``ShuttingDown`` (the drain's grace ran out)."""
        self._commands.put(("expire", None, ShuttingDown(message)))

    def drain(self) -> None:
        """Stop admitting (SIGTERM); requests already admitted run to completion."""
        if self.state in ("loading", "ready"):
            self.state, self.reason = "draining", "the server is shutting down"

    def stop(self, timeout: float = 10.0) -> None:
        self.drain()
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)
        self.state = "stopped"

    @property
    def alive(self) -> bool:
        """False once loading failed or the worker died: only a restart helps then."""
        return self.state != "failed"

    def not_ready_message(self) -> str:
        if self.state == "loading":
            return "the model is still loading; retry shortly"
        return self.reason or f"the server is {self.state}"

    # -- the worker thread ------------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine = self._load()
            if self._warmup:
                warm_up(engine)
        except (Exception, SystemExit) as exc:  # SystemExit: a flag check in the loader
            log.exception("loading the models failed")
            self.state, self.reason = "failed", f"loading the models failed: {type(exc).__name__}: {exc}"
            return
        self.engine = engine
        self.metrics.prefill_chunk.set(int(engine.config.max_prefill_tokens or 0))
        if self.state == "loading":
            self.state = "ready"
        log.info("engine ready: %s", engine.config)
        try:
            self._serve(engine)
        except Exception as exc:  # a bug in the loop itself: fail loudly, and fail liveness
            log.exception("the engine worker died")
            self.state, self.reason = "failed", f"the engine worker died: {type(exc).__name__}: {exc}"
            for tracked in self._tracked.values():
                self._post(tracked.job, EngineFailure(self.reason))

    def _serve(self, engine: Engine) -> None:
        while True:
            for command in self._take_commands(block=not engine.has_unfinished()):
                if command is _STOP:
                    self._fail_all(engine, EngineFailure("the server stopped before the request finished"))
                    self._refuse_pending()
                    return
                kind, job, done = command
                if kind == "add":
                    self._add(engine, job, done)
                elif kind == "expire":  # its third item is the error to end requests with
                    self._fail_all(engine, done)
                else:
                    self._abort(engine, job.id)
                    self._count(engine)
            if engine.has_unfinished():
                self._step(engine)

    def _refuse_pending(self) -> None:
        """Adds that raced with the stop get an answer instead of waiting forever."""
        for command in self._take_commands(block=False):
            if command is not _STOP and command[0] == "add":
                command[2].set_exception(NotReady("the server is shutting down"))

    def _take_commands(self, block: bool) -> list[Any]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, engine: Engine, job: Job, done: concurrent.futures.Future[None]) -> None:
        sequences: list[Sequence] = []
        samples, sources = shared_prompt_logprobs(job.samples)
        try:
            for i, sample in enumerate(samples):
                sequences.append(
                    engine.add_request(f"{job.id}-{i}", sample.prompt_ids, sample.params, group=job.id)
                )
        except Exception as exc:
            for seq in sequences:
                engine.abort(seq.request_id)
            done.set_exception(exc)
            return
        tracked = _Tracked(job, sequences, sources, unfinished=len(sequences))
        self._tracked[job.id] = tracked
        for i, seq in enumerate(sequences):
            self._owner[seq.request_id] = (tracked, i)
        self.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in job.samples))
        self._count(engine)
        done.set_result(None)

    def _abort(self, engine: Engine, job_id: str) -> None:
        tracked = self._tracked.pop(job_id, None)
        for seq in tracked.sequences if tracked else []:
            engine.abort(seq.request_id)
            self._owner.pop(seq.request_id, None)

    def _step(self, engine: Engine) -> None:
        before, fallbacks = replace(engine.totals), collections.Counter(engine.fallback_reasons)
        started = time.monotonic()
        try:
            outputs = engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing the running requests")
            self._fail_all(engine, EngineFailure(f"the engine failed: {type(exc).__name__}: {exc}"))
            return
        now = time.monotonic()
        self.metrics.add_spec(before, engine.totals, engine.fallback_reasons - fallbacks)
        self.metrics.observe_step(engine.last_tree_sizes, engine.last_outcomes)
        for tracked in self._tracked.values():
            if not tracked.admitted and all(seq.slot >= 0 for seq in tracked.sequences):
                tracked.admitted = True
                self.metrics.queue.observe(started - tracked.job.submitted)
                if engine.config.prefix_caching:
                    self.metrics.prefix_queried.inc(sum(len(s.prompt_ids) for s in tracked.sequences))
                    self.metrics.prefix_hits.inc(sum(s.cached_tokens for s in tracked.sequences))
        for out in outputs:
            owner = self._owner.get(out.request_id)
            if owner is None:
                continue
            tracked, index = owner
            self._observe_tokens(tracked, index, len(out.new_token_ids), now)
            stats = (
                {**out.sequence.stats.as_dict(), "cached_tokens": out.sequence.cached_tokens}
                if out.finished
                else {}
            )
            event = Event(
                index,
                list(out.new_token_ids),
                out.text_delta,
                out.finished,
                out.finish_reason,
                stats,
                out.logprobs,
                tracked.prompt_logprobs(index, out.prompt_logprobs),
                out.sequence.error,
            )
            self._post(tracked.job, event)
            if out.finished:
                del self._owner[out.request_id]
                tracked.unfinished -= 1
                if not tracked.unfinished:
                    del self._tracked[tracked.job.id]
                    self.metrics.e2e.observe(now - tracked.job.submitted)
        self._count(engine)

    def _count(self, engine: Engine) -> None:
        """The gauges the autoscaler reads: set after every change, not at the next step."""
        self.metrics.running.set(len(engine.running))
        self.metrics.waiting.set(len(engine.waiting))

    def _observe_tokens(self, tracked: _Tracked, index: int, count: int, now: float) -> None:
        if not count:
            return
        self.metrics.generation_tokens.inc(count)
        if not tracked.first_token:
            tracked.first_token = True
            self.metrics.ttft.observe(now - tracked.job.submitted)
        elif index in tracked.last_token_at:
            self.metrics.observe_gap(now - tracked.last_token_at[index], count)
        tracked.last_token_at[index] = now

    def _fail_all(self, engine: Engine, error: Exception) -> None:
        for job_id, tracked in list(self._tracked.items()):
            self._abort(engine, job_id)
            self._post(tracked.job, error)
        self._count(engine)

    def _post(self, job: Job, item: Event | Exception) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is gone at shutdown: nobody listens
            self._loop.call_soon_threadsafe(job.events.put_nowait, item)
