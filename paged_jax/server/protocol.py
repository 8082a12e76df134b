"""OpenAI request shapes (pydantic) and their translation into SamplingParams.

Fields the engine does not implement are accepted only at their neutral value; anything
else is a 400 that names the field, never a silent no-op. Unknown fields are ignored, as
vLLM and OpenAI do. vLLM's extensions are accepted too: top_k, ignore_eos, stop_token_ids,
and return_token_ids (each choice then carries its token ids).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_jax.core.request import SamplingParams


class RequestError(ValueError):
    """A bad request: HTTP status, the field it concerns, and what to change."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise RequestError("stop strings must be non-empty", "stop")
        return tuple(stop)

    def _check_unsupported(self) -> None:
        if self.n != 1:
            raise RequestError(f"n={self.n} is not supported; this server returns one choice (n=1)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise RequestError(f"{name} is not implemented; leave it at 0", name)
        if self.logit_bias:
            raise RequestError("logit_bias is not implemented; leave it out", "logit_bias")

    def sampling_params(self, max_tokens: int | None, want_logprobs: bool, default_max_tokens: int) -> SamplingParams:
        self._check_unsupported()
        try:
            return SamplingParams(
                max_tokens=default_max_tokens if max_tokens is None else max_tokens, temperature=self.temperature,
                top_k=self.top_k, top_p=self.top_p, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, logprobs=want_logprobs)
        except ValueError as error:  # SamplingParams names the field first: "max_tokens=0 must be ..."
            field = str(error).split("=", 1)[0]
            raise RequestError(str(error), field if field.isidentifier() else None) from None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, description="0 or 1: the sampled token's logprob")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def checked_prompt(self):
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def checked_messages(self) -> list[dict]:
        if not self.messages:
            raise RequestError("messages is empty; send at least one message", "messages")
        if self.top_logprobs not in (None, 0):
            raise RequestError(f"top_logprobs={self.top_logprobs}: alternatives are not computed; use 0",
                               "top_logprobs")
        return [m.model_dump() for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
