"""OpenAI request shapes (pydantic) and their translation into SamplingParams.

Every optional field is nullable, as the OpenAI spec allows: an explicit null means the
default. Fields the engine does not implement are accepted only at their neutral value;
anything else is a 400 that names the field, never a silent no-op. Unknown fields are
ignored, as vLLM and OpenAI do. vLLM's extensions are accepted too: top_k, ignore_eos,
stop_token_ids, repetition_penalty, return_token_ids (each choice then carries its token
ids), and the structured-output extras guided_json / guided_regex / guided_choice /
guided_grammar (or one `structured_outputs` object, vLLM's newer spelling).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_jax.core.request import GuidedDecodingParams, SamplingParams
from paged_jax.structured_output import checked_grammar


class RequestError(ValueError):
    """A bad request: HTTP status, the field it concerns, and what to change."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def _or(value, default):
    return default if value is None else value


class _Strict(BaseModel):
    """Strict types (no "1" for 1, no "true" for true: what the schema says is what passes);
    unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: free text, any JSON object, or JSON valid under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` object: set one of its grammars."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(_Strict):
    model: str | None = Field(default=None, description="the served model's id (default: that model)")
    temperature: float | None = Field(default=None, ge=0, description="0: greedy")
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, description="-1 or 0: off")
    n: int | None = Field(default=None, ge=1, le=1, description="one choice per request")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    kv_transfer_params: dict | None = Field(
        default=None, description='disaggregation: {"do_remote_decode": true} asks a producer to keep the '
        "prompt's KV for a consumer; what a producer returned asks a consumer to pull it")
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, description="1: off")
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise RequestError("stop strings must be non-empty", "stop")
        return tuple(stop)

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The one grammar the request asks for (response_format, a guided_* extra or
        structured_outputs), or None; a 400 naming the fields when it asks for several."""
        given: dict[str, dict] = {}
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                given["response_format"] = {"json_object": True}
            else:
                spec = self.response_format.json_schema
                if spec is None or spec.json_schema is None:
                    raise RequestError("response_format json_schema needs json_schema.schema (a JSON schema)",
                                       "response_format")
                given["response_format"] = {"json": spec.json_schema}
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given[name] = {key: getattr(self, name)}
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        if self.guided_whitespace_pattern is not None:
            raise RequestError("guided_whitespace_pattern is not supported; JSON is written compact",
                               "guided_whitespace_pattern")
        if not given:
            return None
        if len(given) > 1:
            raise RequestError(f"{' and '.join(given)} each ask for a grammar; send one", next(iter(given)))
        (name, fields), = given.items()
        try:
            guided = GuidedDecodingParams(**fields)
            checked_grammar(guided)
        except (ValueError, TypeError) as error:
            raise RequestError(f"{name}: {error}", name) from None
        return guided

    def _check_unsupported(self) -> None:
        if _or(self.n, 1) != 1:
            raise RequestError(f"n={self.n} is not supported; this server returns one choice (n=1)", "n")
        if self.logit_bias:
            raise RequestError("logit_bias is not implemented; leave it out", "logit_bias")

    def sampling_params(self, want_logprobs: bool, guided: GuidedDecodingParams | None = None) -> SamplingParams:
        """The request's SamplingParams, max_tokens left at 1: the route sets it once the
        prompt's length is known (resolve_max_tokens)."""
        self._check_unsupported()
        try:
            return SamplingParams(
                max_tokens=1, temperature=_or(self.temperature, 1.0), top_k=_or(self.top_k, -1),
                top_p=_or(self.top_p, 1.0), seed=self.seed, stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=bool(self.ignore_eos), logprobs=want_logprobs,
                presence_penalty=_or(self.presence_penalty, 0.0), frequency_penalty=_or(self.frequency_penalty, 0.0),
                repetition_penalty=_or(self.repetition_penalty, 1.0), guided_decoding=guided,
                kv_transfer_params=self.kv_transfer_params)
        except ValueError as error:  # SamplingParams names the field first: "top_p=0 must be ..."
            field = str(error).split("=", 1)[0]
            raise RequestError(str(error), field if field.isidentifier() else None) from None


def resolve_max_tokens(requested: int | None, field: str, num_prompt_tokens: int, max_model_len: int,
                       prompt_field: str) -> int:
    """The output budget: `requested`, or with None the rest of the context (vLLM's rule).

    A 400 when the prompt leaves no room, or when prompt + requested exceeds max_model_len
    (vLLM's message), instead of a request that runs for minutes."""
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
                           f"{num_prompt_tokens}; shorten the {prompt_field}", prompt_field)
    if requested is None:
        return room
    if requested < 1:
        raise RequestError(f"{field}={requested} must be >= 1", field)
    if requested > room:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                           f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {prompt_field}, "
                           f"{requested} in the completion). Please reduce the length of the {prompt_field} or "
                           f"{field}.", field)
    return requested


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1, description="16 if omitted; null: the rest of the context")
    logprobs: int | None = Field(default=None, ge=0, le=1, description="0 or 1: the sampled token's logprob")
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def checked_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise RequestError("a batch of prompts is not supported; send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise RequestError("prompt is empty; give text or at least one token id", "prompt")
        for name, unsupported in (("echo", self.echo), ("best_of", self.best_of not in (None, 1)),
                                  ("suffix", self.suffix)):
            if unsupported:
                raise RequestError(f"{name} is not supported; leave it out", name)
        if self.logprobs is not None and self.logprobs not in (0, 1):
            raise RequestError(f"logprobs={self.logprobs}: only the sampled token's logprob is computed; "
                               "ask for 0 or 1", "logprobs")
        return prompt

    @property
    def requested_max_tokens(self) -> int | None:
        """16 when omitted (OpenAI's default for completions), None (the rest) when null."""
        return self.max_tokens if "max_tokens" in self.model_fields_set else 16


class ContentPart(_Strict):
    """One part of a message's content; only text parts are read."""

    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


def message_dicts(messages: list[ChatMessage], field: str = "messages") -> list[dict]:
    """Messages as the chat template reads them: text parts joined with newlines (vLLM's
    rule), other parts a 400 naming them."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None and not message.tool_calls:
            raise RequestError(f"{field}[{i}].content is missing; give the message's text (only an assistant "
                               "message with tool_calls may leave it null)", f"{field}.{i}.content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise RequestError(f"{field}[{i}].content[{j}] is a {part.type!r} part; this model reads "
                                       "text only: send text parts", f"{field}.{i}.content.{j}")
                texts.append(part.text)
            content = "\n".join(texts)
        entry = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=1, description="omitted or null: the rest of the context")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0, description="alternatives are not computed")
    add_generation_prompt: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def checked_messages(self) -> list[dict]:
        if not self.messages:
            raise RequestError("messages is empty; send at least one message", "messages")
        if self.top_logprobs not in (None, 0):
            raise RequestError(f"top_logprobs={self.top_logprobs}: alternatives are not computed; use 0",
                               "top_logprobs")
        return message_dicts(self.messages)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(default=None, description="default: true for a prompt, false for messages")
    add_generation_prompt: bool | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
