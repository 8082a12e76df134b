"""The OpenAI-compatible HTTP front end (FastAPI): completions, chat, models, health, metrics.

Each request becomes one engine request on the AsyncEngine; its tokens come back one step at
a time and are turned into text here (incremental detokenization, stop strings with the
text held back that could still start one). Errors follow OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 for bad input (the field is named),
401 without the API key, 404 for another model, 503 when too many requests wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from paged_jax.core.tokenizer import IncrementalDetokenizer, Tokenizer
from paged_jax.server.engine_loop import AsyncEngine, Delta, QueueFullError
from paged_jax.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError


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


class _ApiKeyMiddleware:
    """401 on /v1 routes without 'Authorization: Bearer <api_key>'.

    A plain ASGI middleware: Starlette's @app.middleware("http") (BaseHTTPMiddleware) relays
    every chunk of a streamed response through a task and a memory stream of its own, a
    cost paid per token per request.
    """

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if dict(scope["headers"]).get(b"authorization", b"") != self._expected:
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                          "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, *, model_name: str, max_model_len: int,
              chat_prompt: Callable, api_key: str | None = None,
              metrics=None) -> FastAPI:
    """The FastAPI app over a started (or to be started) AsyncEngine.

    Args:
      chat_prompt: (messages, add_generation_prompt, sampling_params) -> (prompt token ids,
        sampling_params that also stop at the end of the turn) (LLMEngine.chat_prompt).
    """
    app = FastAPI(title="paged-jax", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}", param=None)
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return error_response(exc.status, str(exc), exc.kind, exc.param)

    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_alive() else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            return Response(status_code=404)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "paged-jax", "max_model_len": max_model_len}]}

    def check_model(name: str) -> None:
        if name != model_name:
            raise RequestError(f"model {name!r} does not exist; this server serves {model_name!r}", "model",
                               404, "not_found_error")

    async def start(request_id: str, prompt, params):
        """Adds the request; returns its delta iterator. Errors become 400 / 503."""
        try:
            return await engine.add_request(request_id, prompt, params)
        except QueueFullError as error:
            raise RequestError(str(error), None, 503, "service_unavailable") from None
        except ValueError as error:
            raise RequestError(str(error), "prompt" if "prompt" in str(error) or "token" in str(error) else None)

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
            return error_response(500, str(error), "server_error")
        finally:
            engine.abort(request_id)  # a disconnect or a stop string; a no-op if the engine finished it
        return make_final("".join(pieces), all_ids, all_logprobs if params.logprobs else None, finish, last)

    def token_logprobs_completion(ids, logprobs, top: bool):
        tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)] if top else None,
                "text_offset": offsets}

    def token_logprobs_chat(ids, logprobs):
        content = []
        for t, lp in zip(ids, logprobs):
            tok = tokenizer.decode([t], skip_special_tokens=False)
            content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []})
        return {"content": content}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        prompt = body.checked_prompt()
        params = body.sampling_params(body.max_tokens, body.logprobs is not None, 16)
        stop = body.stop_strings()
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        top = body.logprobs == 1

        def choice(text, ids, logprobs, finish):
            out = {"index": 0, "text": text, "finish_reason": finish,
                   "logprobs": token_logprobs_completion(ids, logprobs, top) if logprobs is not None else None}
            if body.return_token_ids:
                out["token_ids"] = list(ids)
            return out

        def chunk(text, ids, logprobs, finish):
            base = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}
            if text is None:
                return base
            return base | {"choices": [choice(text, ids, logprobs, finish)]}

        def final(text, ids, logprobs, finish, last):
            return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [choice(text, ids, logprobs, finish)], "usage": usage(last, len(ids))}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await run_request(raw, request_id, prompt, params, stop, body.stream, include_usage, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        messages = body.checked_messages()
        requested = body.requested_max_tokens
        params = body.sampling_params(1 if requested is None else requested, body.logprobs, 16)
        try:
            prompt, params = chat_prompt(messages, body.add_generation_prompt, params)
        except ValueError as error:  # no template, a bad message, a template that raised
            raise RequestError(f"{error} (model {model_name!r})", "messages") from None
        if requested is None:  # OpenAI's default: the rest of the context
            params = dataclasses.replace(params, max_tokens=max(1, max_model_len - len(prompt)))
        stop = body.stop_strings()
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        sent_role = False

        def chunk(text, ids, logprobs, finish):
            nonlocal sent_role
            base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name}
            if text is None:
                return base
            delta = {"content": text}
            if not sent_role:
                delta, sent_role = {"role": "assistant", "content": text}, True
            out = {"index": 0, "delta": delta, "finish_reason": finish,
                   "logprobs": token_logprobs_chat(ids, logprobs) if logprobs is not None else None}
            if body.return_token_ids:
                out["token_ids"] = list(ids)
            return base | {"choices": [out]}

        def final(text, ids, logprobs, finish, last):
            out = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                   "logprobs": token_logprobs_chat(ids, logprobs) if logprobs is not None else None}
            if body.return_token_ids:
                out["token_ids"] = list(ids)
            return {"id": request_id, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [out], "usage": usage(last, len(ids))}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await run_request(raw, request_id, prompt, params, stop, body.stream, include_usage, chunk, final)

    return app


async def _collect(events, pieces, ids, logprobs):
    finish, last = None, None
    async for text, new_ids, new_logprobs, finish, last in events:
        pieces.append(text)
        ids.extend(new_ids)
        if new_logprobs is not None:
            logprobs.extend(new_logprobs)
    return finish, last
