"""Request and response bodies (OpenAI's shapes plus a few multiguess fields).

Types are checked here; value ranges are checked once, by ``SamplingParams`` and the engine,
so the HTTP layer cannot drift from the offline API. Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Shared by every generation endpoint; ``num_candidates``/``depth`` tune speculation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="0 or -1 disables top-k")
    seed: int | None = Field(None, ge=0, le=2**62)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    num_candidates: int | None = Field(None, description="tree width for this request (<= the server's)")
    depth: int | None = Field(None, description="tree depth for this request (<= the server's; 0: off)")


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class GenerateRequest(SamplingFields):
    """The original guide's endpoint: greedy by default; ``chat`` wraps the prompt as one user
    message in the target's chat template (instruct models answer nothing to a bare prompt)."""

    prompt: str
    chat: bool = False
    max_tokens: int | None = 128
    temperature: float = 0.0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecSummary(BaseModel):
    """What speculation did for this response (summed over its samples)."""

    verify_steps: int
    draft_tokens: int
    accepted_tokens: int
    fallback_steps: int
    mean_accepted_length: float


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    multiguess: SpecSummary


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    multiguess: SpecSummary


class GenerateResponse(BaseModel):
    result: str
    finish_reason: str | None
    usage: Usage
    multiguess: SpecSummary


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "multiguess"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
