"""The generation endpoints: /v1/completions, /v1/chat/completions and /generate.

Each handler turns its body into samples (``translate``), admits them (``Scheduler.submit``),
and either collects the events into one response or streams them as server-sent events.
Whatever happens (done, timeout, client gone), the job is released, which aborts its work.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from multiguess.api import sse
from multiguess.api.errors import APIError, error_body, from_exception
from multiguess.api.gate import tenant_of
from multiguess.api.prompt_text import text_ids
from multiguess.api.schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    GenerateResponse,
    SamplingFields,
)
from multiguess.api.structured import Reply, check_event, check_structure, requested_structure
from multiguess.api.translate import (
    Outcome,
    chat_logprobs,
    chat_logprobs_body,
    chat_prompt,
    check_sample_count,
    completion_logprobs_body,
    completion_options,
    completion_prompts,
    make_samples,
    refuse_unsupported,
    sampling_params,
)
from multiguess.engine.intake import check_prompt_ids
from multiguess.engine.logprobs import TokenLogprob
from multiguess.scheduler import EngineFailure, Event, Job, RequestTimeout, Sample, Scheduler

router = APIRouter()
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events when streaming"}
}
ChunkFn = Callable[[Event], dict[str, Any] | None]
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


async def off_loop(tokenize: Callable[..., T], *args: Any) -> T:
    """Tokenizing a long prompt takes seconds: in a worker thread, so that health checks and
    running streams are answered meanwhile."""
    return await run_in_threadpool(tokenize, *args)


async def rendered_off_loop(build: Callable[[], BaseModel]) -> Response:
    """A collected response built and serialised in a worker thread: with echoed prompts and
    log-probabilities it runs to megabytes, and built on the event loop it would hold health
    checks and running streams for seconds."""

    def render() -> Response:
        return Response(build().model_dump_json(by_alias=True), media_type="application/json")

    return await run_in_threadpool(render)


def scheduler_of(request: Request) -> Scheduler:
    scheduler: Scheduler = request.app.state.scheduler
    scheduler.check_ready()
    return scheduler


def check_model(request: Request, model: str | None) -> str:
    served: str = request.app.state.settings.model_name
    if model is not None and model != served:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
    return served


async def build_samples(
    scheduler: Scheduler,
    body: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    n: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    tenant: str | None = None,
) -> list[Sample]:
    """``max_tokens=None`` means whatever context the longest prompt leaves; ``logprobs``,
    ``prompt_logprobs``: alternatives to record per generated and prompt token (None: none);
    ``tenant``: the API key's (``gate.tenant_of``). The grammar is checked off the event loop:
    a complex one costs up to a second of lexer work."""
    refuse_unsupported(body)
    structure = requested_structure(body)
    if structure is not None:
        await off_loop(check_structure, scheduler.engine.grammars, structure)  # type: ignore[union-attr]
    config = scheduler.engine.config  # type: ignore[union-attr]
    check_sample_count(len(prompts), n, scheduler.max_samples)
    for prompt in prompts:  # before anything decodes them (echo)
        check_prompt_ids(prompt, scheduler.engine.target.vocab_size)  # type: ignore[union-attr]
    if max_tokens is None:
        max_tokens = max(1, config.max_model_len - max(len(p) for p in prompts))
    params = sampling_params(body, max_tokens, n, config, logprobs, prompt_logprobs, tenant)
    if structure is not None:
        params = replace(params, structured_outputs=structure.spec)
    return make_samples(prompts, params)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, job: Job, n: int) -> Outcome:
    """All of a job's events, unless the client disconnects first (then ``ClientGone``)."""

    async def consume() -> Outcome:
        outcome = Outcome(job.samples, n)
        while not job.done:
            outcome.add(check_event(await job.next_event()))
        return outcome

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
    if consumer.done() and not consumer.cancelled():
        return consumer.result()
    raise ClientGone


async def run_collected(request: Request, scheduler: Scheduler, samples: list[Sample], n: int) -> Outcome:
    job = await scheduler.submit(samples)
    try:
        return await collect(request, job, n)
    finally:
        scheduler.release(job)


def stream(
    scheduler: Scheduler,
    job: Job,
    n: int,
    opening: list[dict[str, Any]],
    chunk: ChunkFn,
    usage_chunk: Callable[[Outcome], dict[str, Any]] | None,
) -> StreamingResponse:
    """Events as SSE frames; a deadline, an engine failure or a failed grammar becomes an error
    frame, then the end."""

    async def frames() -> AsyncIterator[str]:
        outcome = Outcome(job.samples, n)
        try:
            for payload in opening:
                yield sse.frame(payload)
            while not job.done:
                event = check_event(await job.next_event())
                outcome.add(event)
                payload = chunk(event)
                if payload is not None:
                    yield sse.frame(payload)
            if usage_chunk is not None:
                yield sse.frame(usage_chunk(outcome))
            yield sse.DONE
        except (RequestTimeout, EngineFailure, APIError) as exc:
            err = from_exception(exc)
            yield sse.frame(error_body(err.status, err.message, err.param, err.code))
        finally:
            scheduler.release(job)

    # The background task also runs when the client disconnects before the first frame.
    return StreamingResponse(
        frames(), media_type="text/event-stream", background=BackgroundTask(scheduler.release, job)
    )


def gone() -> Response:
    return Response(status_code=499)


def header(kind: str, model: str) -> dict[str, Any]:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}


@router.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Any:
    model = check_model(request, body.model)
    scheduler = scheduler_of(request)
    prompts = await off_loop(completion_prompts, body, scheduler.engine.tokenizer)  # type: ignore[union-attr]
    tokenizer = scheduler.engine.tokenizer  # type: ignore[union-attr]
    logprobs, prompt_logprobs, best_of = completion_options(body)
    samples = await build_samples(
        scheduler,
        body,
        prompts,
        body.max_tokens,
        best_of,
        logprobs,
        prompt_logprobs,
        tenant=tenant_of(request.scope),
    )
    echoed = [tokenizer.decode(s.prompt_ids) if body.echo else "" for s in samples]
    top = body.logprobs or 0

    def logprobs_body(
        index: int, records: list[TokenLogprob], prompt: list[TokenLogprob] | None, offset: int
    ) -> CompletionLogprobs:
        """With ``echo`` the prompt's records (``prompt``) lead the generated ones."""
        if prompt is None:
            return completion_logprobs_body(records, tokenizer, top, offset)
        first = samples[index].prompt_ids[0]
        return completion_logprobs_body([*prompt, *records], tokenizer, top, offset, first)

    head = header("cmpl", model)
    if body.stream:
        job = await scheduler.submit(samples)
        kind = "text_completion"
        offsets = [0] * len(samples)
        unsent = set(range(len(samples))) if body.echo else set()  # echoes lead a first chunk

        def chunk(event: Event) -> dict[str, Any] | None:
            echo = event.index in unsent
            unsent.discard(event.index)
            text = (echoed[event.index] if echo else "") + event.text
            if not text and not event.finished and not event.logprobs and not echo:
                return None
            lp = None
            if body.logprobs is not None:
                prompt = (event.prompt_logprobs or []) if echo else None
                lp = logprobs_body(event.index, event.logprobs, prompt, offsets[event.index])
                offsets[event.index] += sum(len(t) for t in lp.tokens)
            choice = {
                "index": event.index,
                "text": text,
                "logprobs": lp.model_dump() if lp else None,
                "finish_reason": event.finish_reason,
            }
            return {**head, "object": kind, "choices": [choice]}

        return stream(scheduler, job, best_of, [], chunk, usage_chunk(head, kind, body))
    try:
        outcome = await run_collected(request, scheduler, samples, best_of)
    except ClientGone:
        return gone()

    def build() -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i,
                text=echoed[s] + outcome.texts[s],
                logprobs=(
                    logprobs_body(
                        s, outcome.logprobs[s], outcome.prompt_logprobs[s] if body.echo else None, 0
                    )
                    if body.logprobs is not None
                    else None
                ),
                finish_reason=outcome.finish_reasons[s],
            )
            for i, s in enumerate(outcome.best(body.n))
        ]
        return CompletionResponse(
            **head, choices=choices, usage=outcome.usage(), multiguess=outcome.summary()
        )

    return await rendered_off_loop(build)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    model = check_model(request, body.model)
    scheduler = scheduler_of(request)
    prompt = await off_loop(chat_prompt, body.messages, scheduler.engine.tokenizer, body.tools)  # type: ignore[union-attr]
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = chat_logprobs(body)
    samples = await build_samples(
        scheduler, body, [prompt], max_tokens, body.n, top, tenant=tenant_of(request.scope)
    )
    reply = Reply.of(body, len(samples))
    tokenizer = scheduler.engine.tokenizer  # type: ignore[union-attr]
    head = header("chatcmpl", model)
    if body.stream:
        job = await scheduler.submit(samples)
        kind = "chat.completion.chunk"
        opening = [
            {
                **head,
                "object": kind,
                "choices": [
                    {
                        "index": i,
                        "delta": reply.opening_delta(i),
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(len(samples))
        ]

        def chunk(event: Event) -> dict[str, Any] | None:
            if not event.text and not event.finished and not event.logprobs:
                return None
            lp = chat_logprobs_body(event.logprobs, tokenizer, top).model_dump() if top is not None else None
            choice = {
                "index": event.index,
                "delta": reply.delta(event.text),
                "logprobs": lp,
                "finish_reason": reply.finish_reason(event.finish_reason),
            }
            return {**head, "object": kind, "choices": [choice]}

        return stream(scheduler, job, body.n, opening, chunk, usage_chunk(head, kind, body))
    try:
        outcome = await run_collected(request, scheduler, samples, body.n)
    except ClientGone:
        return gone()

    def build() -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=reply.message(i, text),
                logprobs=chat_logprobs_body(outcome.logprobs[i], tokenizer, top) if top is not None else None,
                finish_reason=reply.finish_reason(reason),
            )
            for i, (text, reason) in enumerate(zip(outcome.texts, outcome.finish_reasons, strict=True))
        ]
        return ChatCompletionResponse(
            **head, choices=choices, usage=outcome.usage(), multiguess=outcome.summary()
        )

    return await rendered_off_loop(build)


def usage_chunk(
    head: dict[str, Any], kind: str, body: CompletionRequest | ChatCompletionRequest
) -> Callable[[Outcome], dict[str, Any]] | None:
    """The last chunk (``stream_options.include_usage``): no choices, usage and multiguess stats."""
    if not (body.stream_options and body.stream_options.include_usage):
        return None

    def build(outcome: Outcome) -> dict[str, Any]:
        return {
            **head,
            "object": kind,
            "choices": [],
            "usage": outcome.usage().model_dump(),
            "multiguess": outcome.summary().model_dump(),
        }

    return build


@router.post("/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, request: Request) -> Any:
    scheduler = scheduler_of(request)
    tokenizer = scheduler.engine.tokenizer  # type: ignore[union-attr]
    if body.chat:
        prompt = await off_loop(chat_prompt, [ChatMessage(role="user", content=body.prompt)], tokenizer)
    else:
        prompt = await off_loop(text_ids, tokenizer, body.prompt)
    samples = await build_samples(
        scheduler, body, [prompt], body.max_tokens, 1, tenant=tenant_of(request.scope)
    )
    try:
        outcome = await run_collected(request, scheduler, samples, 1)
    except ClientGone:
        return gone()
    return GenerateResponse(
        result=outcome.texts[0],
        finish_reason=outcome.finish_reasons[0],
        usage=outcome.usage(),
        multiguess=outcome.summary(),
    )
