"""The prefill/decode disaggregation proxy: `python -m paged_jax proxy` (FastAPI + httpx2).

It stands in front of producers (`serve --kv-role producer`) and consumers (`serve
--kv-role consumer`) and answers the OpenAI routes as one server would, in the shape of
vLLM's disaggregated proxy (vllm/examples/online_serving/disaggregated_serving/). Each
/v1/completions or /v1/chat/completions request runs in two legs, each sent to the next
server of its kind in turn (round-robin):

- prefill: the client's body goes to a producer with max_tokens 1 (and chat's
  max_completion_tokens 1 when given), stream false, no stream_options and
  kv_transfer_params {"do_remote_decode": true}. The producer computes the prompt's KV,
  offers its pages, and answers with the kv_transfer_params that name them (opaque here;
  null when it has nothing to offer).
- decode: the client's own body (its stream flag and all) goes to a consumer with those
  kv_transfer_params (without the field when they are null); the consumer pulls the pages
  and decodes. Its answer is relayed as it comes: an SSE stream byte for byte, chunk by
  chunk as the consumer sends it, or its JSON with its status.

Fault rules: the client always gets an answer, and no upstream call waits longer than the
timeout (to connect, or for the next bytes).
- A producer unreachable, timed out, answering 5xx, or answering something other than a
  JSON object whose kv_transfer_params is an object or null: the decode leg goes without
  kv_transfer_params (the consumer prefills the prompt itself), counted in prefill_fallbacks.
- A producer's 4xx (a bad request, which the consumer would refuse too): its body and status
  go to the client, and no consumer is asked.
- A consumer unreachable or timed out before it answers: 502 with OpenAI's error object. One
  that breaks off mid-stream: the stream ends with an SSE error event (the server's own
  shape for a request that fails mid-stream). A status of its own (a 4xx, 503 while busy)
  reaches the client unchanged. decode_errors counts all three and its 5xx answers.
- A client that disconnects mid-stream closes the consumer's stream, which aborts the request.

GET /v1/models and GET or HEAD /health are a consumer's answers (the next one in turn);
GET /proxy/stats the proxy's counters.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import socket
from urllib.parse import urlsplit

import anyio
import httpx2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from paged_jax.server.middleware import error_response

log = logging.getLogger(__name__)


def _root_url(url: str, flag: str) -> str:
    """`url` without a trailing slash, once it names a server's root: http(s)://HOST[:PORT]."""
    parts = urlsplit(url)
    try:
        port_ok = parts.port != 0  # .port raises on a port that is not a number in 0..65535
    except ValueError:
        port_ok = False
    if (parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.path.strip("/")
            or parts.query or parts.fragment):
        raise ValueError(f"{flag} {url!r}: give a server's root URL, http://HOST:PORT (the proxy adds the /v1 "
                         "routes itself)")
    return url.rstrip("/")


class _Upstreams:
    """The servers of one leg, taken in turn; num_requests counts the requests sent to each."""

    def __init__(self, urls: list[str], flag: str):
        if not urls:
            raise ValueError(f"no {flag} server: give at least one ({flag} URL)")
        self.urls = [_root_url(url, flag) for url in urls]
        self.num_requests = dict.fromkeys(self.urls, 0)
        self._turns = itertools.cycle(self.urls)

    def pick(self) -> str:
        url = next(self._turns)
        self.num_requests[url] += 1
        return url


def _upstream_headers(request: Request) -> dict[str, str]:
    """The headers of the client's request that travel upstream: its API key (the servers may
    require one). Compression is refused because SSE bytes are relayed raw, as they arrive."""
    headers = {"accept-encoding": "identity"}
    if "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    return headers


def _relayed(answer: httpx2.Response) -> Response:
    """An upstream's whole (read) answer, as the client's: same status, body and content type."""
    return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))


def _failure(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _bad_gateway(url: str, error: Exception) -> Response:
    return error_response(502, f"the consumer {url} did not answer: {_failure(error)}")


class _RelayedStream(StreamingResponse):
    """A consumer's SSE answer, relayed chunk by chunk as its bytes arrive.

    The consumer's response is closed when this one ends, however it ends: a client that
    disconnects cancels the task sending this response, and one cancelled at a yield rather
    than in a read from the consumer would leave the generator suspended, its connection
    open until garbage collected; the closed connection is what makes the consumer abort.
    """

    def __init__(self, answer: httpx2.Response, url: str, counters: dict[str, int]):
        self._answer, self._url, self._counters = answer, url, counters
        super().__init__(self._chunks(), status_code=answer.status_code,
                         media_type=answer.headers.get("content-type", "text/event-stream"))

    async def _chunks(self):
        try:
            async for chunk in self._answer.aiter_raw():
                yield chunk
        except httpx2.TransportError as error:  # it broke off, or sent nothing for the timeout
            self._counters["decode_errors"] += 1
            event = {"error": {"message": f"the consumer {self._url} broke off the stream: {_failure(error)}",
                               "type": "server_error", "param": None, "code": 502}}
            yield f"data: {json.dumps(event)}\n\n"

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # closes even while the request task is cancelled
                await self._answer.aclose()


def make_proxy_app(prefill_urls: list[str], decode_urls: list[str], timeout: float = 600.0) -> FastAPI:
    """The proxy's FastAPI app (the module docstring says what it does).

    Args:
      prefill_urls: the producers' root URLs (http://HOST:PORT), taken in turn for prefill legs.
      decode_urls: the consumers' root URLs, taken in turn for decode legs and the routes
        passed through (/v1/models, /health).
      timeout: seconds any upstream call may wait to connect, or for the next bytes of its answer.
    Returns:
      The app; its one HTTP client (pooled connections) opens and closes with its lifespan.
    """
    producers, consumers = _Upstreams(prefill_urls, "--prefill"), _Upstreams(decode_urls, "--decode")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds (--timeout)")
    counters = {"requests": 0, "prefill_fallbacks": 0, "decode_errors": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # One client pools the connections of every call: our servers keep idle connections
        # open, so they are reused. No cap on them: the servers bound their own queues (503).
        async with httpx2.AsyncClient(timeout=timeout, limits=httpx2.Limits(max_connections=None),
                                      trust_env=False) as client:  # the upstreams given, never an env proxy
            app.state.client = client
            yield

    app = FastAPI(title="paged-jax proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def fallback(url: str, reason: str) -> None:
        """Counts a failed prefill leg; returns its offer: none, so the consumer prefills."""
        counters["prefill_fallbacks"] += 1
        log.warning("paged-jax proxy: prefill on %s failed (%s); the consumer prefills the prompt itself", url, reason)

    async def prefill(client: httpx2.AsyncClient, path: str, body: dict, headers: dict) -> dict | None | Response:
        """The kv_transfer_params a producer offers for `body`; None when it offers none or
        failed (the consumer prefills); its answer itself when it refused the request (4xx)."""
        url = producers.pick()
        try:
            answer = await client.post(url + path, json=body, headers=headers)
        except httpx2.TransportError as error:
            return fallback(url, _failure(error))
        if answer.is_client_error:
            return _relayed(answer)
        if not answer.is_success:
            return fallback(url, f"HTTP {answer.status_code}")
        try:
            payload = answer.json()
        except ValueError:
            payload = None
        offer = payload.get("kv_transfer_params") if isinstance(payload, dict) else "not a JSON object"
        if offer is None or isinstance(offer, dict):
            return offer
        return fallback(url, f"its answer's kv_transfer_params is {offer!r}, not an object or null")

    async def decode(client: httpx2.AsyncClient, path: str, body: dict, headers: dict) -> Response:
        """The consumer's answer to `body`: a stream relayed as it comes, else whole; 502 when none came."""
        url = consumers.pick()
        try:
            answer = await client.send(client.build_request("POST", url + path, json=body, headers=headers),
                                       stream=True)
        except httpx2.TransportError as error:
            counters["decode_errors"] += 1
            return _bad_gateway(url, error)
        if body.get("stream") is True and answer.is_success:
            return _RelayedStream(answer, url, counters)
        try:
            await answer.aread()
        except httpx2.TransportError as error:
            counters["decode_errors"] += 1
            return _bad_gateway(url, error)
        finally:
            await answer.aclose()
        if answer.is_server_error:
            counters["decode_errors"] += 1
        return _relayed(answer)

    async def disaggregated(request: Request, chat: bool) -> Response:
        counters["requests"] += 1
        try:
            body = await request.json()
        except ValueError as error:
            return error_response(400, f"the body is not valid JSON: {error}")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object (an OpenAI request)")
        prefill_body = {key: value for key, value in body.items() if key != "stream_options"}
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if chat and body.get("max_completion_tokens") is not None:
            prefill_body["max_completion_tokens"] = 1
        client, path, headers = request.app.state.client, request.url.path, _upstream_headers(request)
        offer = await prefill(client, path, prefill_body, headers)
        if isinstance(offer, Response):
            return offer
        decode_body = {key: value for key, value in body.items() if key != "kv_transfer_params"}
        if offer is not None:
            decode_body["kv_transfer_params"] = offer
        return await decode(client, path, decode_body, headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await disaggregated(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await disaggregated(request, chat=True)

    @app.get("/v1/models")
    @app.get("/v1/models/{model_id:path}")
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def passed_through(request: Request) -> Response:
        url = consumers.pick()
        try:
            answer = await request.app.state.client.request(request.method, url + request.url.path,
                                                            headers=_upstream_headers(request))
        except httpx2.TransportError as error:
            return _bad_gateway(url, error)
        return _relayed(answer)

    @app.get("/proxy/stats")
    async def stats() -> dict:
        return {**counters, "prefill_requests": producers.num_requests, "decode_requests": consumers.num_requests}

    return app


def run_proxy(host: str, port: int, prefill_urls: list[str], decode_urls: list[str], timeout: float = 600.0, *,
              sock: socket.socket | None = None) -> None:
    """Serves make_proxy_app(prefill_urls, decode_urls, timeout) on host:port until interrupted,
    and prints one line once it listens.

    Args:
      sock: a socket already bound to host:port (the CLI binds it to report a port in use
        its own way); None: one is bound here.
    """
    app = make_proxy_app(prefill_urls, decode_urls, timeout)
    if sock is None:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.listen(2048)  # uvicorn's default backlog
    address = f"[{host}]" if ":" in host else host
    print(f"paged-jax: proxy listening at http://{address}:{sock.getsockname()[1]}/v1 (prefill: "
          f"{', '.join(prefill_urls)}; decode: {', '.join(decode_urls)})", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
