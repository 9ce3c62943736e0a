"""Request and response bodies (OpenAI's shapes plus a few multiguess fields).

Types are checked here; value ranges are checked once, by ``SamplingParams`` and the engine,
so the HTTP layer cannot drift from the offline API. Nothing is ignored silently: an unknown
field is a 400 naming it, and OpenAI fields the server cannot honour are declared here and
refused with the reason (``translate.refuse_unsupported``). Types are strict, as JSON spells
them: a boolean is not an integer, a string is not a number, and a ``logit_bias`` key is a token
id in canonical decimal (``"05"``, ``"+5"``, ``" 5"`` and ``"٥"`` are not token 5).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from multiguess.params import MAX_LOGPROBS


def token_id_key(key: str) -> str:
    """A token id as OpenAI's ``logit_bias`` keys spell it: ASCII digits, no sign, no spaces, no
    leading zero; anything else would name a token the caller did not write."""
    if not (key.isascii() and key.isdigit() and (key == "0" or not key.startswith("0"))):
        raise ValueError(
            "keys must be token ids in decimal (0, 1, 2, ...), without sign, spaces or leading zeros"
        )
    return key


TokenIdKey = Annotated[str, AfterValidator(token_id_key)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str = Field(..., max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="the output always follows the schema, strict or not")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Body):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = Field(None, description="the arguments always follow the schema, strict or not")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class Prediction(_Body):
    """OpenAI's predicted output: the text the reply is expected to be (a code edit's file)."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SamplingFields(_Body):
    """Shared by every generation endpoint; ``num_candidates``/``depth`` tune speculation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="0 or -1 disables top-k")
    seed: int | None = Field(None, ge=0, le=2**62)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, description="[-2, 2]: subtracted once from every generated token")
    frequency_penalty: float = Field(0.0, description="[-2, 2]: subtracted per occurrence in the output")
    repetition_penalty: float = Field(1.0, description="vLLM's: > 0, 1 is off; prompt and output tokens")
    logit_bias: dict[TokenIdKey, float] | None = Field(None, description="token id -> bias in [-100, 100]")
    min_tokens: int = Field(0, description="vLLM's: no end-of-sequence or stop token before this many")
    user: str | None = Field(None, description="an end-user identifier; not used for generation")
    num_candidates: int | None = Field(None, description="tree width for this request (<= the server's)")
    depth: int | None = Field(None, description="tree depth for this request (<= the server's; 0: off)")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="vLLM's: the prompt reuses cached KV only of requests of the same tenant and salt",
    )
    # Structured output (api/structured.py): OpenAI's response_format, or vLLM's fields.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM's: a regex the whole output matches")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the output is one of these")
    guided_grammar: str | None = Field(None, description="vLLM's: a Lark grammar (llguidance's dialect)")
    structured_outputs: StructuredOutputs | None = None
    prediction: Prediction | None = Field(None, description="predicted output: drafts follow it")


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    n: int = 1
    best_of: int | None = Field(None, description="samples per prompt to choose the n most likely from")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives per token")
    suffix: str | None = Field(None, description="not supported: a non-empty suffix is a 400")
    split_special_tokens: bool = Field(
        True,
        description="special-token strings in text prompts are plain text; false: they are control "
        "tokens (vLLM's and transformers' default)",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="passed to the chat template with the message")
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="an assistant's calls, for the template"
    )
    tool_call_id: str | None = Field(None, description="the call a tool message answers, for the template")


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = Field(None, description="tags; stored nowhere (store is false)")
    store: bool = Field(False, description="true is a 400: the server stores no completions")
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    parallel_tool_calls: bool | None = Field(None, description="meaningful only with tools")
    prompt_cache_key: str | None = Field(None, description="a caching hint; not used")
    safety_identifier: str | None = Field(None, description="an end-user identifier; not used for generation")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # OpenAI fields this server refuses with a 400 saying why (see translate.refuse_unsupported).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None


class GenerateRequest(SamplingFields):
    """The original guide's endpoint: greedy by default; ``chat`` wraps the prompt as one user
    message in the target's chat template (instruct models answer nothing to a bare prompt)."""

    prompt: str
    chat: bool = False
    max_tokens: int | None = 128
    temperature: float = 0.0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    """OpenAI's predicted-output counts: prediction tokens the target accepted as drafts, and
    those it verified and rejected."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails = CompletionTokensDetails()


class SpecSummary(BaseModel):
    """What speculation did for this response (summed over its samples)."""

    verify_steps: int
    draft_tokens: int
    accepted_tokens: int
    fallback_steps: int
    # By source (SpecStats): the drafter's own nodes (model), copy drafts (the request's text,
    # recent outputs) and drafts that follow the prediction; steps: the verify steps it drafted in.
    model_draft_tokens: int = 0
    model_accepted_tokens: int = 0
    model_steps: int = 0
    copy_draft_tokens: int = 0
    copy_accepted_tokens: int = 0
    copy_steps: int = 0
    prediction_draft_tokens: int = 0
    prediction_accepted_tokens: int = 0
    prediction_steps: int = 0
    mean_accepted_length: float
    model_mean_accepted_length: float = 0.0
    copy_mean_accepted_length: float = 0.0
    prediction_mean_accepted_length: float = 0.0


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: parallel lists, one entry per token (with ``echo``, the prompt's
    first, whose log-probability and alternatives are null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    multiguess: SpecSummary


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
