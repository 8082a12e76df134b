"""The server's response shapes (pydantic), for its OpenAPI schema only.

The routes return plain dicts (a response model would validate every reply, a cost per
request); these models document what those dicts hold, so that /openapi.json says what the
server does: every status it returns, with OpenAI's error object, and the right content
types (tests/test_server_openai.py runs schemathesis against it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error object, on every 4xx and 5xx."""

    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "abort"] | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A completion, or (with stream) each `data:` event of its text/event-stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict | None = Field(default=None, description="a producer's answer (disaggregation): "
                                            "where a consumer pulls the prompt's KV")


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    """A chat completion; with stream, text/event-stream of chat.completion.chunk events."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    kv_transfer_params: dict | None = Field(default=None, description="a producer's answer (disaggregation): "
                                            "where a consumer pulls the prompt's KV")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def _error(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


BAD_REQUEST = {400: _error("bad input: the error's param names the field, its message the fix")}
AUTH = {401: _error("missing or wrong API key (only when the server has one)")}
NOT_FOUND = {404: _error("no such model")}
TOO_LARGE = {413: _error("the body is larger than the server accepts")}
UNAVAILABLE = {503: _error("too many requests wait, or the engine is not running")}
SERVER_ERROR = {500: _error("the engine failed this request")}


# One server-sent event of a stream: `data:` holds a chunk's JSON (the route's response shape,
# with `delta` for chat), an {"error": ...} object if the engine failed, or "[DONE]".
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
             "required": ["data"]}


def generation(model: type[BaseModel]) -> dict:
    """The responses of a generating route: JSON, or an SSE stream with stream=true."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": SSE_EVENT}},
                  "description": "the result; text/event-stream with stream=true"},
            **BAD_REQUEST, **AUTH, **NOT_FOUND, **TOO_LARGE, **SERVER_ERROR, **UNAVAILABLE}
