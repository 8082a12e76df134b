"""The disaggregation proxy (paged_jax/server/proxy.py) against fake producers and consumers.

The fakes are small FastAPI apps served by uvicorn on threads, on free loopback ports; they
record every request they get (in one log shared by all, so the order of the legs shows)
and answer as the servers' contract says: a producer with kv_transfer_params naming itself
and the request, a consumer with a fixed answer or a fixed SSE stream. The engine-backed
end to end run is the servers' own test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time

import anyio
import httpx2
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged_jax.server.proxy import make_proxy_app

WAIT = 10.0  # seconds any wait of these tests may last before it fails
COMPLETION = {"model": "fake", "prompt": "The paged cache", "max_tokens": 16, "temperature": 0.0}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 16}


@contextlib.contextmanager
def serving(app):
    """Runs an ASGI app with uvicorn on a thread, on a free loopback port bound beforehand;
    yields its URL once it accepts connections, and stops it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@contextlib.contextmanager
def silent_port():
    """The URL of a port that accepts connections (the kernel's backlog) and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def closed_port_url() -> str:
    """The URL of a loopback port nothing listens on: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def completion_body(name: str, chat: bool) -> dict:
    """The whole answer fake server `name` gives to a non-streamed request."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": f"hi from {name}"}, "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": f" text from {name}", "logprobs": None, "finish_reason": "length"}
    return {"id": f"cmpl-{name}", "object": "chat.completion" if chat else "text_completion", "created": 0,
            "model": "fake", "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def stream_chunks(name: str) -> list[bytes]:
    """The SSE chunks fake consumer `name` streams, each one write of its own."""
    def event(text, finish):
        chunk = {"id": f"cmpl-{name}", "object": "text_completion", "created": 0, "model": "fake",
                 "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
        return f"data: {json.dumps(chunk)}\n\n".encode()
    return [event(" one", None), event(" two", None), event(" three", "length"), b"data: [DONE]\n\n"]


class Fake:
    """A fake producer or consumer. `received` holds (path, body, authorization header) of each
    POST, `log` (shared) the (name, path) of each request of every fake, in order.

    status: the status of its completion answers (an error object unless 200).
    offer: a producer's kv_transfer_params are {"do_remote_prefill", "remote", "transfer_id"}
      naming it and the request; False: null (nothing to offer).
    release: a stream sends its first chunk, then waits (at most WAIT) until this is set to send
      the rest; `stream_cancelled` is set when the client went away meanwhile.
    breaks: a stream fails after its first chunk (the connection closes without the rest).
    """

    def __init__(self, name: str, log: list, *, status: int = 200, offer: bool = True):
        self.name, self.log, self.status, self.offer = name, log, status, offer
        self.breaks = False
        self.received: list[tuple[str, dict, str | None]] = []
        self.release, self.stream_cancelled = threading.Event(), threading.Event()
        self.release.set()
        self.app = FastAPI()
        self.app.post("/v1/completions")(self.complete)
        self.app.post("/v1/chat/completions")(self.complete)
        self.app.get("/v1/models")(self.models)
        self.app.api_route("/health", methods=["GET", "HEAD"])(self.health)

    async def complete(self, request: Request) -> Response:
        path, body = request.url.path, await request.json()
        self.log.append((self.name, path))
        self.received.append((path, body, request.headers.get("authorization")))
        if self.status != 200:
            return JSONResponse({"error": {"message": f"{self.name} says no", "type": "invalid_request_error",
                                           "param": "prompt", "code": self.status}}, status_code=self.status)
        if body.get("stream"):
            return StreamingResponse(self.stream(), media_type="text/event-stream")
        answer = completion_body(self.name, chat=path.endswith("/chat/completions"))
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = None if not self.offer else {
                "do_remote_prefill": True, "remote": self.name, "transfer_id": f"{self.name}-{len(self.received)}"}
        return JSONResponse(answer)

    async def stream(self):
        first, *rest = stream_chunks(self.name)
        yield first
        try:
            deadline = time.monotonic() + WAIT
            while not self.release.is_set() and time.monotonic() < deadline:
                await anyio.sleep(0.01)
        except BaseException:  # cancelled (the client disconnected) or closed
            self.stream_cancelled.set()
            raise
        if self.breaks:
            raise RuntimeError(f"{self.name} broke off its stream")
        for chunk in rest:
            yield chunk

    async def models(self) -> dict:
        self.log.append((self.name, "/v1/models"))
        return {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": self.name}]}

    async def health(self, request: Request) -> Response:
        self.log.append((self.name, "/health"))
        return Response(status_code=200)


@contextlib.contextmanager
def proxied(producers: list[Fake | str], consumers: list[Fake | str], timeout: float = WAIT):
    """Serves the fakes (or takes URLs as they are) and a proxy over them; yields the proxy's URL."""
    with contextlib.ExitStack() as stack:
        def url(upstream):
            return upstream if isinstance(upstream, str) else stack.enter_context(serving(upstream.app))
        app = make_proxy_app([url(p) for p in producers], [url(c) for c in consumers], timeout)
        yield stack.enter_context(serving(app))


def post(url: str, body, **kw) -> httpx2.Response:
    return httpx2.post(url, json=body, timeout=WAIT, **kw)


def get_stats(proxy: str) -> dict:
    return httpx2.get(f"{proxy}/proxy/stats", timeout=WAIT).json()


def openai_client(proxy: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy}/v1", api_key="sk-test", timeout=WAIT, max_retries=0)


# the two legs

@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_prefill_on_the_producer_then_decode_on_the_consumer(path, body):
    log = []
    producer, consumer = Fake("p", log), Fake("c", log)
    body = {**body, "kv_transfer_params": {"from": "the client"}}  # replaced on both legs
    with proxied([producer], [consumer]) as proxy:
        answer = post(proxy + path, body, headers={"Authorization": "Bearer sk-test"})
    assert answer.status_code == 200
    assert log == [("p", path), ("c", path)]
    [(_, prefill_body, prefill_key)] = producer.received
    expected = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    if "max_completion_tokens" in body:
        expected["max_completion_tokens"] = 1
    assert prefill_body == expected
    [(_, decode_body, decode_key)] = consumer.received
    offer = {"do_remote_prefill": True, "remote": "p", "transfer_id": "p-1"}
    assert decode_body == {**body, "kv_transfer_params": offer}
    assert prefill_key == decode_key == "Bearer sk-test"
    assert answer.json() == completion_body("c", chat=path.endswith("/chat/completions"))


def test_a_stream_reaches_the_client_chunk_by_chunk_and_byte_for_byte():
    log = []
    producer, consumer = Fake("p", log), Fake("c", log)
    consumer.release.clear()  # the consumer holds the rest of its stream back until the client read the start
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with proxied([producer], [consumer]) as proxy:
        with httpx2.stream("POST", f"{proxy}/v1/completions", json=body, timeout=WAIT) as answer:
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            chunks = answer.iter_raw()
            first = next(chunks)  # a proxy that buffered the stream would time out here
            assert first == stream_chunks("c")[0]
            consumer.release.set()
            rest = b"".join(chunks)
    assert first + rest == b"".join(stream_chunks("c"))
    [(_, prefill_body, _)] = producer.received
    assert prefill_body["stream"] is False and "stream_options" not in prefill_body
    [(_, decode_body, _)] = consumer.received
    assert decode_body == {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote": "p",
                                                          "transfer_id": "p-1"}}


def test_the_openai_client_works_through_the_proxy():
    log = []
    producer, consumer = Fake("p", log), Fake("c", log)
    with proxied([producer], [consumer]) as proxy:
        client = openai_client(proxy)
        whole = client.completions.create(model="fake", prompt="The paged cache", max_tokens=4)
        streamed = [chunk.choices[0].text for chunk in
                    client.completions.create(model="fake", prompt="The paged cache", max_tokens=4, stream=True)]
        models = client.models.list()
    assert whole.choices[0].text == " text from c"
    assert streamed == [" one", " two", " three"]
    assert [m.owned_by for m in models.data] == ["c"]  # /v1/models is the consumer's
    assert log == [("p", "/v1/completions"), ("c", "/v1/completions")] * 2 + [("c", "/v1/models")]
    assert [key for _, _, key in producer.received + consumer.received] == ["Bearer sk-test"] * 4


# faults

@pytest.mark.parametrize("producer_state", ["down", "HTTP 500", "silent", "no offer"])
def test_a_failed_prefill_falls_back_to_decoding_with_a_local_prefill(producer_state):
    log = []
    consumer = Fake("c", log)
    with contextlib.ExitStack() as stack:
        producer = {"down": closed_port_url, "HTTP 500": lambda: Fake("p", log, status=500),
                    "silent": lambda: stack.enter_context(silent_port()),
                    "no offer": lambda: Fake("p", log, offer=False)}[producer_state]()
        proxy = stack.enter_context(proxied([producer], [consumer], timeout=0.5))
        start = time.monotonic()
        answer = post(f"{proxy}/v1/completions", COMPLETION)
        elapsed = time.monotonic() - start
        stats = get_stats(proxy)
    assert answer.status_code == 200 and answer.json() == completion_body("c", chat=False)
    [(_, decode_body, _)] = consumer.received
    assert decode_body == COMPLETION  # no kv_transfer_params: the consumer prefills
    failed = producer_state != "no offer"  # a producer with nothing to offer did not fail
    assert stats["prefill_fallbacks"] == int(failed) and stats["decode_errors"] == 0
    assert stats["requests"] == 1
    assert elapsed < 3.0, f"the fallback took {elapsed:.1f} s with a 0.5 s timeout"


def test_a_request_the_producer_refuses_is_answered_by_the_producer():
    log = []
    producer, consumer = Fake("p", log, status=400), Fake("c", log)
    with proxied([producer], [consumer]) as proxy:
        answer = post(f"{proxy}/v1/chat/completions", CHAT)
        stats = get_stats(proxy)
    assert answer.status_code == 400
    assert answer.json() == {"error": {"message": "p says no", "type": "invalid_request_error", "param": "prompt",
                                       "code": 400}}
    assert consumer.received == [] and log == [("p", "/v1/chat/completions")]
    assert stats["prefill_fallbacks"] == 0 and list(stats["decode_requests"].values()) == [0]


@pytest.mark.parametrize("consumer_state", ["down", "silent"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_consumer_that_gives_no_answer_is_a_502(consumer_state, stream):
    log = []
    with contextlib.ExitStack() as stack:
        consumer = closed_port_url() if consumer_state == "down" else stack.enter_context(silent_port())
        proxy = stack.enter_context(proxied([Fake("p", log)], [consumer], timeout=0.5))
        start = time.monotonic()
        answer = post(f"{proxy}/v1/completions", {**COMPLETION, "stream": stream})
        elapsed = time.monotonic() - start
        stats = get_stats(proxy)
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 502 and error["type"] == "server_error" and error["param"] is None
    assert consumer in error["message"]
    assert stats["decode_errors"] == 1 and stats["prefill_fallbacks"] == 0
    assert elapsed < 3.0, f"the 502 took {elapsed:.1f} s with a 0.5 s timeout"


def test_a_consumers_own_error_and_its_broken_stream_reach_the_client():
    log = []
    consumer = Fake("c", log, status=503)
    body = {**COMPLETION, "stream": True}
    with proxied([Fake("p", log)], [consumer]) as proxy:
        busy = post(f"{proxy}/v1/completions", body)
        consumer.status, consumer.breaks = 200, True
        broken = post(f"{proxy}/v1/completions", body)
        stats = get_stats(proxy)
    assert busy.status_code == 503 and busy.json()["error"]["message"] == "c says no"  # its status, not a 502
    assert broken.status_code == 200 and broken.content.startswith(stream_chunks("c")[0])
    *_, last = broken.text.strip().split("\n\n")
    error = json.loads(last.removeprefix("data: "))["error"]
    assert error["code"] == 502 and "broke off the stream" in error["message"]
    assert stats["decode_errors"] == 2 and stats["prefill_fallbacks"] == 0


def test_a_client_that_disconnects_mid_stream_closes_the_consumers_stream():
    log = []
    consumer = Fake("c", log)
    consumer.release.clear()  # never set: the consumer's stream waits after its first chunk
    with proxied([Fake("p", log)], [consumer]) as proxy:
        with httpx2.stream("POST", f"{proxy}/v1/completions", json={**COMPLETION, "stream": True},
                           timeout=WAIT) as answer:
            assert next(answer.iter_raw()) == stream_chunks("c")[0]
        # leaving the block closed the connection mid-stream
        assert consumer.stream_cancelled.wait(WAIT), "the consumer's stream outlived the client"


# several servers

def test_legs_go_round_robin_over_producers_and_consumers():
    log = []
    producers, consumers = [Fake("p0", log), Fake("p1", log)], [Fake("c0", log), Fake("c1", log)]
    with proxied(producers, consumers) as proxy:
        answers = [post(f"{proxy}/v1/completions", COMPLETION).json() for _ in range(4)]
        stats = get_stats(proxy)
    path = "/v1/completions"
    assert log == [("p0", path), ("c0", path), ("p1", path), ("c1", path)] * 2
    assert [a["id"] for a in answers] == ["cmpl-c0", "cmpl-c1"] * 2
    # each consumer pulls what the producer of its request offered
    assert [body["kv_transfer_params"]["transfer_id"] for c in consumers for _, body, _ in c.received] == [
        "p0-1", "p0-2", "p1-1", "p1-2"]
    assert sorted(stats["prefill_requests"].values()) == [2, 2] and len(stats["prefill_requests"]) == 2
    assert sorted(stats["decode_requests"].values()) == [2, 2] and len(stats["decode_requests"]) == 2
    assert stats["requests"] == 4 and stats["prefill_fallbacks"] == stats["decode_errors"] == 0


def test_health_is_a_consumers():
    log = []
    with proxied([Fake("p", log)], [Fake("c", log)]) as proxy:
        assert httpx2.get(f"{proxy}/health", timeout=WAIT).status_code == 200
        assert httpx2.head(f"{proxy}/health", timeout=WAIT).status_code == 200
    assert log == [("c", "/health")] * 2
    with proxied([Fake("p", log)], [closed_port_url()]) as proxy:
        assert httpx2.get(f"{proxy}/health", timeout=WAIT).status_code == 502


# flags and the command line

@pytest.mark.parametrize("kwargs,message", [
    ({"prefill_urls": []}, "no --prefill server"),
    ({"decode_urls": ["ftp://127.0.0.1:8200"]}, "--decode 'ftp://127.0.0.1:8200': give a server's root URL"),
    ({"prefill_urls": ["http://127.0.0.1:8100/v1"]}, "--prefill 'http://127.0.0.1:8100/v1'"),
    ({"prefill_urls": ["http://127.0.0.1:99999"]}, "--prefill 'http://127.0.0.1:99999'"),
    ({"timeout": 0}, "timeout=0 must be > 0 seconds"),
])
def test_bad_arguments_name_the_fix(kwargs, message):
    args = {"prefill_urls": ["http://127.0.0.1:8100"], "decode_urls": ["http://127.0.0.1:8200/"], "timeout": 1.0}
    with pytest.raises(ValueError, match=re.escape(message)):
        make_proxy_app(**{**args, **kwargs})


def _cli(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "paged_jax", "proxy", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("port,decode,message", [
    ("0x", "http://127.0.0.1:8200", "argument --port: '0x' is not a port"),
    ("0", "http://127.0.0.1:8200/v1", "paged-jax: error: --decode 'http://127.0.0.1:8200/v1': give a server's root"),
])
def test_the_command_refuses_a_bad_port_or_url(port, decode, message):
    with _cli("--port", port, "--prefill", "http://127.0.0.1:8100", "--decode", decode) as process:
        _, err = process.communicate(timeout=60)
    assert process.returncode == 2, err
    assert message in err and "Traceback" not in err


def test_the_command_serves_its_stats():
    producer, consumer = closed_port_url(), closed_port_url()
    with _cli("--port", "0", "--prefill", producer, "--decode", consumer, "--timeout", "5") as process:
        try:
            ready, _, _ = select.select([process.stdout], [], [], 60)
            assert ready, "the proxy printed nothing within 60 s"
            line = process.stdout.readline()
            assert line.startswith("paged-jax: proxy listening at http://127.0.0.1:"), line
            url = line.split()[4].removesuffix("/v1")
            stats = httpx2.get(f"{url}/proxy/stats", timeout=WAIT).json()
        finally:
            process.kill()
            process.communicate(timeout=WAIT)
    assert stats == {"requests": 0, "prefill_fallbacks": 0, "decode_errors": 0, "prefill_requests": {producer: 0},
                     "decode_requests": {consumer: 0}}


def test_the_proxy_imports_no_jax():
    code = "import sys, paged_jax.server.proxy; assert 'jax' not in sys.modules, 'the proxy imported jax'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
