"""The OpenAI-compatible HTTP front end (FastAPI): completions, chat, models, tokenize, health,
metrics, version.

Each request is checked and tokenized here, in the HTTP process, and becomes one engine
request on the AsyncEngine only once it is valid and fits the context; its tokens come
back one step at a time and are turned into text here (incremental detokenization, stop
strings with the text held back that could still start one). Errors follow OpenAI's shape
on every status, {"error": {"message", "type", "param", "code"}}: 400 for bad input (the
field is named), 401 without the API key, 404 for another model or route, 413 for a body
over the limit, 500 when the engine failed the request, 503 when too many requests wait
or no engine runs. Structured outputs (response_format, guided_*) and tool calls
(tool_calls.py) become the request's GuidedDecodingParams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from paged_jax.chat import ToolsUnsupportedError
from paged_jax.core.request import SamplingParams
from paged_jax.core.tokenizer import IncrementalDetokenizer, Tokenizer
from paged_jax.server import responses as docs
from paged_jax.server.engine_loop import AsyncEngine, Delta, QueueFullError
from paged_jax.server.middleware import MAX_BODY_BYTES, ApiKeyMiddleware, BodyLimitMiddleware, error_response
from paged_jax.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, NamedToolChoice,
                                       RequestError, TokenizeRequest, message_dicts, resolve_max_tokens)
from paged_jax.tool_calls import check_tool_choice, check_tools, parse_tool_calls, tool_guidance

# Prompts longer than this (characters) are tokenized on a worker thread, so one huge prompt
# does not stall every other stream's chunks on the event loop.
_INLINE_TOKENIZE_CHARS = 32768


class TextStream:
    """Token deltas -> final text, cut at the first stop string.

    While running, the last (longest stop string - 1) characters are held back: they could
    be the start of a stop string that the next token completes.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stopped = False

    def push(self, token_ids) -> str:
        """Adds tokens; returns the text that can be sent now. Sets `stopped` on a stop string."""
        self.text += self._detok.push(token_ids)
        if self._stop:
            start = max(0, self._sent - self._hold)
            hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                return self.flush()
        end = len(self.text) - self._hold
        if end <= self._sent:
            return ""
        out, self._sent = self.text[self._sent:end], end
        return out

    def flush(self) -> str:
        """At the end: everything not sent yet, a trailing incomplete character included."""
        if not self.stopped:
            self.text += self._detok.finish()
        out, self._sent = self.text[self._sent:], len(self.text)
        return out


class _AbortingStream(StreamingResponse):
    """An SSE response that aborts its engine request when it ends, however it ends.

    A client that disconnects cancels the task sending the response while our generator
    may be suspended at a yield, where its own finally would only run when it is garbage
    collected; this hook runs when the response itself ends (a no-op for a request the
    engine already finished, and the cut-off for one that hit a stop string).
    """

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _version() -> str:
    try:
        return metadata.version("paged-jax")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, *, model_name: str, max_model_len: int,
              chat_prompt: Callable, api_key: str | None = None, metrics=None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app over a started (or to be started) AsyncEngine.

    Args:
      chat_prompt: (messages, add_generation_prompt, sampling_params, tools=None) -> (prompt
        token ids, sampling_params that also stop at the end of the turn) (chat.chat_prompt).
      max_body_bytes: larger request bodies get 413 before they are read.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes} must be >= 1")
    version = _version()
    app = FastAPI(title="paged-jax", version=version, docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}")
        param = ".".join(loc) or None
        given = first.get("input")
        got = f" (got {given!r})" if isinstance(given, (int, float, str, bool)) and len(repr(given)) < 80 else ""
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}{got}", param=param)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return error_response(exc.status, str(exc), exc.kind, exc.param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):  # no such route, a wrong method
        message = f"{request.method} {request.url.path}: {exc.detail}"
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    # status routes
    @app.api_route("/health", methods=["GET", "HEAD"], response_class=Response,
                   responses={200: {"description": "the engine runs", "content": {}},
                              503: {"description": "the engine is not running", "content": {}}})
    async def health():
        return Response(status_code=200 if engine.is_alive() else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}},
                        404: {"model": docs.ErrorResponse, "description": "this server keeps no metrics"}})
    async def prometheus_metrics():
        if metrics is None:
            return error_response(404, "this server keeps no metrics")
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", responses={200: {"model": docs.VersionResponse}})
    async def get_version():
        return {"version": version}

    # models
    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "paged-jax",
                "max_model_len": max_model_len}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise RequestError(f"model {name!r} does not exist; this server serves {model_name!r}", "model", 404)

    @app.get("/v1/models", responses={200: {"model": docs.ModelList}, **docs.AUTH})
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses={200: {"model": docs.ModelCard}, **docs.AUTH, **docs.NOT_FOUND})
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    # tokenizer routes (vLLM's; its benchmark client aligns prompt lengths with them)
    def render(messages, add_generation_prompt: bool, params, tools=None):
        try:
            return chat_prompt(messages, add_generation_prompt, params, tools=tools)
        except ToolsUnsupportedError as error:
            raise RequestError(f"{error} (model {model_name!r})", "tools") from None
        except ValueError as error:  # no template, a bad message, a template that raised
            raise RequestError(f"{error} (model {model_name!r})", "messages") from None

    async def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)

    def checked_tools(raw_tools) -> list[dict] | None:
        if not raw_tools:
            return None
        try:
            return check_tools([tool.model_dump(exclude_none=True) for tool in raw_tools])
        except ValueError as error:
            raise RequestError(str(error), "tools") from None

    @app.post("/tokenize", responses={200: {"model": docs.TokenizeResponse}, **docs.BAD_REQUEST, **docs.NOT_FOUND,
                                      **docs.TOO_LARGE})
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            ids = await encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            ids, _ = render(message_dicts(body.messages), body.add_generation_prompt is not False, SamplingParams(),
                            checked_tools(body.tools))
        strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", responses={200: {"model": docs.DetokenizeResponse}, **docs.BAD_REQUEST,
                                        **docs.NOT_FOUND, **docs.TOO_LARGE})
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    # generation
    async def start(request_id: str, prompt, params):
        """Adds the request; returns its delta iterator. Errors become 400 / 503."""
        try:
            return await engine.add_request(request_id, prompt, params)
        except QueueFullError as error:
            raise RequestError(str(error), None, 503) from None
        except ValueError as error:  # the engine's own checks: token ids, a grammar llguidance rejects
            text = str(error)
            param = "guided_decoding" if "guided" in text or "grammar" in text else "prompt"
            raise RequestError(text, param) from None

    def usage(delta: Delta, num_tokens: int) -> dict:
        return {"prompt_tokens": delta.num_prompt_tokens, "completion_tokens": num_tokens,
                "total_tokens": delta.num_prompt_tokens + num_tokens,
                "prompt_tokens_details": {"cached_tokens": delta.num_cached_tokens}}

    async def run_request(raw: Request, request_id: str, prompt, params, stop, stream: bool, include_usage: bool,
                          make_chunk, make_final):
        """Streams (SSE) or collects one request.

        make_chunk(text, token_ids, logprobs, finish_reason) -> a chunk payload (or None to skip);
        make_final(text, token_ids, logprobs, finish_reason, last_delta) -> the whole response.
        """
        deltas = await start(request_id, prompt, params)
        text_stream = TextStream(tokenizer, stop)

        async def consume():
            """Yields (text, ids, logprobs, finish_reason, delta) per delta until the end."""
            async for delta in deltas:
                if delta.error is not None:
                    raise RuntimeError(delta.error)
                text = text_stream.push(delta.token_ids)
                finish = delta.finish_reason
                if text_stream.stopped:
                    finish = "stop"
                elif finish is not None:
                    text += text_stream.flush()
                yield text, delta.token_ids, delta.logprobs, finish, delta
                if finish is not None:
                    return

        if stream:
            async def events():
                num_tokens = 0
                try:
                    async for text, ids, logprobs, finish, delta in consume():
                        num_tokens += len(ids)
                        chunk = make_chunk(text, ids, logprobs, finish)
                        if chunk is not None:
                            yield _sse(chunk)
                        if finish is not None and include_usage:
                            yield _sse(make_chunk(None, (), None, None) | {"choices": [],
                                                                           "usage": usage(delta, num_tokens)})
                    yield "data: [DONE]\n\n"
                except RuntimeError as error:
                    yield _sse({"error": {"message": str(error), "type": "server_error", "param": None,
                                          "code": 500}})

            return _AbortingStream(events(), on_close=lambda: engine.abort(request_id))

        pieces, all_ids, all_logprobs = [], [], []
        consumer = asyncio.ensure_future(_collect(consume(), pieces, all_ids, all_logprobs))
        try:
            while not consumer.done():
                done, _ = await asyncio.wait({consumer}, timeout=0.5)
                if not done and await raw.is_disconnected():
                    consumer.cancel()
                    return Response(status_code=499)
            finish, last = consumer.result()
        except RuntimeError as error:
            return error_response(500, str(error))
        finally:
            engine.abort(request_id)  # a disconnect or a stop string; a no-op if the engine finished it
        return make_final("".join(pieces), all_ids, all_logprobs if params.logprobs else None, finish, last)

    def token_logprobs_completion(ids, logprobs, top: bool, offset: int) -> dict:
        """The completion logprobs of `ids`, the first of which starts at text `offset`."""
        tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)] if top else None,
                "text_offset": offsets}

    def token_logprobs_chat(ids, logprobs):
        content = []
        for t, lp in zip(ids, logprobs):
            tok = tokenizer.decode([t], skip_special_tokens=False)
            content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []})
        return {"content": content}

    @app.post("/v1/completions", responses=docs.generation(docs.CompletionResponse))
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        prompt = body.checked_prompt()
        params = body.sampling_params(body.logprobs is not None, body.guided_decoding())
        prompt_ids = await encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = resolve_max_tokens(body.requested_max_tokens, "max_tokens", len(prompt_ids), max_model_len,
                                        "prompt")
        params = dataclasses.replace(params, max_tokens=max_tokens)
        stop = body.stop_strings()
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        top = body.logprobs == 1
        text_offset = 0  # of the next streamed token, in the whole completion's text

        def choice(text, ids, logprobs, finish, offset=0):
            out = {"index": 0, "text": text, "finish_reason": finish,
                   "logprobs": token_logprobs_completion(ids, logprobs, top, offset) if logprobs is not None else None}
            if body.return_token_ids:
                out["token_ids"] = list(ids)
            return out

        def chunk(text, ids, logprobs, finish):
            nonlocal text_offset
            base = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}
            if text is None:
                return base
            out = choice(text, ids, logprobs, finish, text_offset)
            if out["logprobs"] is not None:
                text_offset += sum(map(len, out["logprobs"]["tokens"]))
            return base | {"choices": [out]}

        def final(text, ids, logprobs, finish, last):
            return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [choice(text, ids, logprobs, finish)], "usage": usage(last, len(ids)),
                    "kv_transfer_params": last.kv_transfer_params}

        return await run_request(raw, request_id, prompt_ids, params, stop, body.streaming, body.include_usage,
                                 chunk, final)

    @app.post("/v1/chat/completions", responses=docs.generation(docs.ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        messages = body.checked_messages()
        tools = checked_tools(body.tools)
        raw_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        try:
            tool_choice = check_tool_choice(raw_choice, tools)
        except ValueError as error:
            raise RequestError(str(error), "tool_choice") from None
        guided = body.guided_decoding()
        tool_guided = tool_guidance(tools, tool_choice, body.parallel_tool_calls is not False) if tools else None
        if guided is not None and tool_guided is not None:
            raise RequestError(f"tool_choice={raw_choice!r} guides the reply into tool calls, which cannot also follow "
                               "response_format or guided_*; drop one of them", "tool_choice")
        params = body.sampling_params(bool(body.logprobs), guided or tool_guided)
        prompt, params = render(messages, body.add_generation_prompt is not False, params, tools)
        max_tokens = resolve_max_tokens(body.requested_max_tokens, body.max_tokens_field, len(prompt), max_model_len,
                                        "messages")
        params = dataclasses.replace(params, max_tokens=max_tokens)
        stop = body.stop_strings()
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        # With tools, a reply may be calls: it is held back and parsed whole at the end.
        parse_calls = tools is not None and tool_choice != "none"
        sent_role, held = False, []

        def message(text):
            """(message fields, finish_reason override) of a whole reply."""
            if not parse_calls:
                return {"content": text}, None
            content, calls = parse_tool_calls(text, tool_choice)
            return ({"content": content, "tool_calls": calls} if calls else {"content": content}), \
                ("tool_calls" if calls else None)

        def chunk(text, ids, logprobs, finish):
            nonlocal sent_role
            base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name}
            if text is None:
                return base
            delta = {"content": text}
            if parse_calls:
                held.append(text)
                if finish is None:
                    return None
                delta, override = message("".join(held))
                if "tool_calls" in delta:
                    delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(delta["tool_calls"])]
                finish = override if override and finish == "stop" else finish
            if not sent_role:
                delta, sent_role = {"role": "assistant"} | delta, True
            out = {"index": 0, "delta": delta, "finish_reason": finish,
                   "logprobs": token_logprobs_chat(ids, logprobs) if logprobs is not None else None}
            if body.return_token_ids:
                out["token_ids"] = list(ids)
            return base | {"choices": [out]}

        def final(text, ids, logprobs, finish, last):
            fields, override = message(text)
            out = {"index": 0, "message": {"role": "assistant"} | fields,
                   "finish_reason": override if override and finish == "stop" else finish,
                   "logprobs": token_logprobs_chat(ids, logprobs) if logprobs is not None else None}
            if body.return_token_ids:
                out["token_ids"] = list(ids)
            return {"id": request_id, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [out], "usage": usage(last, len(ids)),
                    "kv_transfer_params": last.kv_transfer_params}

        return await run_request(raw, request_id, prompt, params, stop, body.streaming, body.include_usage,
                                 chunk, final)

    def openapi() -> dict:
        """FastAPI's schema, made true to the server: no 422 (validation errors are 400s,
        documented per route with the other statuses each route returns)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            schema["components"]["schemas"].pop("HTTPValidationError", None)
            schema["components"]["schemas"].pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


async def _collect(events, pieces, ids, logprobs):
    finish, last = None, None
    async for text, new_ids, new_logprobs, finish, last in events:
        pieces.append(text)
        ids.extend(new_ids)
        if new_logprobs is not None:
            logprobs.extend(new_logprobs)
    return finish, last
