"""The OpenAI-compatible server, driven by the official `openai` client over loopback.

Each server runs in this process on 127.0.0.1 (a free port), on its own engine with the
tests' tiny weights; the reference is LLM.generate / LLM.chat on another engine with the
same weights (seeded sampling draws the same tokens in any batch). Every request loop is
bounded in count and time, and every server is stopped by its fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from engine_reference import MAX_MODEL_LEN, big_llm, dense_greedy
from paged_jax.core.request import SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig
from paged_jax.server import make_server

openai = pytest.importorskip("openai", reason="the server tests drive the official openai client")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL = "tiny"
TIMEOUT = 120.0


@contextlib.contextmanager
def running_server(**kwargs):
    """A server on its own engine (tiny weights), on a free loopback port; stopped on exit."""
    base = big_llm().engine
    engine_args = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=64)
    engine_args.update(kwargs.pop("engine_args", {}))
    engine = LLMEngine(EngineConfig(model="tiny", **engine_args), model=base.model, tokenizer=base.tokenizer)
    kwargs.setdefault("chat_template", CHATML)
    with serving(make_server(engine, model_name=MODEL, **kwargs)) as (url, server):
        yield url, server, engine


@contextlib.contextmanager
def serving(server):
    """Runs a PagedJaxServer on a thread, on a free loopback port; yields (url, server) once
    it accepts connections and stops it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.stop()
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def served():
    with running_server() as handle:
        yield handle


def http(url, body: bytes | None = None, headers=None) -> tuple[int, str]:
    """(status, body text) of a GET (no body) or POST, 4xx/5xx included."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def http_status(url) -> int | None:
    """The status of a GET, or None while nothing listens."""
    try:
        return http(url)[0]
    except OSError:
        return None


def client(url, **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=kw.pop("api_key", "none"), timeout=TIMEOUT, max_retries=0)


def metric_value(url, name: str) -> float:
    """One sample of /metrics (the first series of that name)."""
    for line in http(f"{url}/metrics")[1].splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


def wait_idle(engine, url, timeout=30.0):
    """Until /metrics says no request runs or waits and no KV block is in use."""
    deadline = time.time() + timeout
    while True:
        text = http(f"{url}/metrics")[1]
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("vllm:") and "{" in line}
        if (values["vllm:num_requests_running"], values["vllm:num_requests_waiting"],
                values["vllm:kv_cache_usage_perc"]) == (0, 0, 0):
            return values
        assert time.time() < deadline, f"the server did not go idle: {values}"
        time.sleep(0.05)


# (prompt, sampling) pairs: text and ids, greedy and seeded sampling
CASES = [
    ("The paged cache", dict(temperature=0.0, max_tokens=12)),
    ([5, 9, 300, 41, 7], dict(temperature=0.9, top_p=0.9, seed=3, max_tokens=10)),
    ("Prefix caching saves", dict(temperature=0.7, seed=11, max_tokens=16)),
]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_match_llm_generate(served, stream):
    url, _, engine = served
    c = client(url)
    for prompt, sampling in CASES:
        ref = big_llm().generate([prompt], SamplingParams(ignore_eos=True, **sampling), use_tqdm=False)[0]
        kwargs = dict(model=MODEL, prompt=prompt, extra_body={"return_token_ids": True, "ignore_eos": True},
                      **sampling)
        if stream:
            chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
            assert chunks[-1].usage.completion_tokens == len(ref.token_ids) and not chunks[-1].choices
        else:
            out = c.completions.create(**kwargs)
            ids, text, finish = out.choices[0].model_extra["token_ids"], out.choices[0].text, out.choices[0].finish_reason
            assert out.usage.completion_tokens == len(ids) and out.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert ids == ref.token_ids, f"{prompt!r}: server tokens differ from LLM.generate"
        assert text == ref.text and finish == ref.finish_reason == "length"
    wait_idle(engine, url)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_llm_chat(served, stream):
    url, _, engine = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    sampling = dict(temperature=0.8, seed=5, max_tokens=14)
    ref = big_llm().chat(messages, SamplingParams(ignore_eos=True, **sampling), chat_template=CHATML,
                         use_tqdm=False)[0]
    c = client(url)
    kwargs = dict(model=MODEL, messages=messages, extra_body={"return_token_ids": True, "ignore_eos": True},
                  **sampling)
    if stream:
        chunks = list(c.chat.completions.create(stream=True, **kwargs))
        assert chunks[0].choices[0].delta.role == "assistant"
        ids = [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    else:
        out = c.chat.completions.create(**kwargs)
        ids, text = out.choices[0].model_extra["token_ids"], out.choices[0].message.content
        assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == len(ids)
    assert ids == ref.token_ids and text == ref.text
    wait_idle(engine, url)


def test_logprobs_and_stop_strings(served):
    url, _, engine = served
    c = client(url)
    ref = big_llm().generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, logprobs=True,
                                                       ignore_eos=True), use_tqdm=False)[0]
    out = c.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=12, logprobs=1,
                               extra_body={"ignore_eos": True})
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(ref.outputs[0].logprobs, abs=1e-5)
    # A stop string taken from the middle of the reference text: the reply ends right before it.
    stop = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 3]
    assert stop and stop in ref.text
    for stream in (False, True):
        got = c.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=12, stop=[stop],
                                   stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(got)
            text, finish = "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = got.choices[0].text, got.choices[0].finish_reason
        assert text == ref.text[:ref.text.index(stop)] and finish == "stop"
    wait_idle(engine, url)


def test_64_concurrent_streams_and_8_cancelled(served):
    url, _, engine = served

    async def run():
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        counts = {}

        async def one(i):
            hang_up = i % 8 == 7  # 8 of the 64 ask for many tokens and hang up mid-stream
            n = 200 if hang_up else 4 + i % 13
            stream = await c.completions.create(model=MODEL, prompt=[3 + i, 40, 50 + i % 7], max_tokens=n,
                                                temperature=0.5, seed=i, stream=True,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
            got = 0
            async for chunk in stream:
                got += len(chunk.choices[0].model_extra["token_ids"])
                if hang_up and got >= 2:
                    await stream.close()
                    counts[i] = None
                    return
            counts[i] = (got, n)

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), TIMEOUT)
        await c.close()
        return counts

    aborted_before = engine.get_stats()["num_aborted"]
    counts = asyncio.run(run())
    assert sum(v is None for v in counts.values()) == 8
    assert all(got == want for got, want in (v for v in counts.values() if v is not None))
    wait_idle(engine, url)  # the cancelled ones were aborted and their blocks freed
    stats = engine.get_stats()
    # Each hang-up aborted its request (none reached its 200 tokens) and freed its blocks.
    assert stats["num_aborted"] - aborted_before == 8 and stats["kv_cache_usage"] == 0.0
    engine.kv_cache_manager.check_invariants()


BAD_REQUESTS = [
    ("completions", b'{"model": "tiny", "prompt": "x", ', 400, None),  # malformed JSON
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": list(range(MAX_MODEL_LEN + 1))}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
]


def test_bad_requests_get_400_while_a_good_stream_finishes(served):
    url, _, engine = served
    c = client(url)
    ref = big_llm().generate(["A long answer"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                             use_tqdm=False)[0]
    good = c.completions.create(model=MODEL, prompt="A long answer", temperature=0, max_tokens=40, stream=True,
                                extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = []
    for i, chunk in enumerate(good):
        ids += chunk.choices[0].model_extra["token_ids"]
        if i == 1:  # mid-stream, every bad request in turn
            for path, body, status, param in BAD_REQUESTS:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                code, text = http(f"{url}/v1/{path}", content, {"content-type": "application/json"})
                assert code == status, (path, body, text)
                error = json.loads(text)["error"]
                assert error["message"] and error["param"] == param, (body, error)
    assert ids == ref.token_ids, "the good stream was disturbed by the bad requests"
    wait_idle(engine, url)
    engine.kv_cache_manager.check_invariants()


def test_models_and_health(served):
    url, _, _ = served
    assert http(f"{url}/health")[0] == 200
    assert [m.id for m in client(url).models.list().data] == [MODEL]


def test_queue_bound_gives_503_and_api_key_is_checked():
    with running_server(engine_args=dict(max_num_seqs=1), max_waiting_requests=2, api_key="sekret") as (url, _, engine):
        assert http(f"{url}/v1/models")[0] == 401
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").models.list()
        c = client(url, api_key="sekret")
        long = c.completions.create(model=MODEL, prompt="one", max_tokens=200, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
        next(iter(long))  # it runs: the one running slot is taken
        waiting = [c.completions.create(model=MODEL, prompt="w", max_tokens=2, stream=True) for _ in range(2)]
        with pytest.raises(openai.APIStatusError) as refused:
            c.completions.create(model=MODEL, prompt="three", max_tokens=2)
        assert refused.value.status_code == 503 and "waiting" in refused.value.message
        for s in (long, *waiting):
            s.close()
        wait_idle(engine, url)


def _engine_processes(pid: int) -> list[int]:
    """The processes `pid` spawned with multiprocessing (Linux /proc; its resource tracker aside)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    spawned = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                spawned.append(child)
    return spawned


def test_reserved_cpus_is_checked():
    from paged_jax.server.engine_core import check_reserved_cpus

    allowed = len(os.sched_getaffinity(0))
    for bad in (-1, allowed, allowed + 3):
        with pytest.raises(ValueError, match=f"reserved_cpus={bad}: pass 0 to {allowed - 1}"):
            check_reserved_cpus(bad)
    for good in (None, 0, *range(1, allowed)):
        check_reserved_cpus(good)
    with pytest.raises(ValueError, match="reserved_cpus applies to an engine process of its own"):
        make_server(big_llm(), port=0, reserved_cpus=1)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the engine process through /proc")
def test_serve_runs_the_engine_in_its_own_process():
    """`python -m paged_jax serve` as users run it: the engine process gives LLM.generate's
    tokens, a hung-up stream frees its blocks, and when the engine process dies the open
    stream ends with an error and the server exits non-zero (nothing hangs)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    reserved = 1 if len(os.sched_getaffinity(0)) >= 2 else 0
    server = subprocess.Popen([sys.executable, "-m", "paged_jax", "serve", "--model", "tiny", "--port", str(port),
                               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                               "--max-num-batched-tokens", "64", "--reserved-cpus", str(reserved)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while http_status(f"{url}/health") != 200:
            assert server.poll() is None and time.time() < deadline, f"serve did not start:\n{server.stdout.read()}"
            time.sleep(0.5)
        (engine_pid,) = _engine_processes(server.pid)
        # jax's native library is mapped in the engine process only: HTTP never imported jax.
        for pid, loads_jax in ((server.pid, False), (engine_pid, True)):
            with open(f"/proc/{pid}/maps") as f:
                assert ("jaxlib" in f.read()) == loads_jax, f"process {pid}: jaxlib mapped is not {loads_jax}"
        # --reserved-cpus 1: on the CPU backend the engine process leaves the last core to HTTP.
        allowed = sorted(os.sched_getaffinity(server.pid))
        assert sorted(os.sched_getaffinity(engine_pid)) == allowed[:len(allowed) - reserved]
        assert metric_value(url, "paged_jax:engine_reserved_cpus") == reserved
        c = client(url)
        for prompt, sampling in CASES:
            ref = big_llm().generate([prompt], SamplingParams(ignore_eos=True, **sampling), use_tqdm=False)[0]
            chunks = c.completions.create(model=MODEL, prompt=prompt, stream=True,
                                          extra_body={"return_token_ids": True, "ignore_eos": True}, **sampling)
            ids = [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]]
            assert ids == ref.token_ids, f"{prompt!r}: the engine process's tokens differ from LLM.generate"
        hung_up = c.completions.create(model=MODEL, prompt="hang up", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
        next(iter(hung_up))
        hung_up.close()
        wait_idle(None, url)  # aborted in the engine process, its blocks freed

        running = c.completions.create(model=MODEL, prompt="a long one", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
        next(iter(running))
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.time()
        with pytest.raises(openai.APIError) as failed:
            for _ in running:
                pass
        # The server ended the stream with an error of its own, not the client's timeout, and
        # exits non-zero (test_server_faults.py: the message, --restart-engine).
        assert not isinstance(failed.value, openai.APITimeoutError) and time.time() - killed < 30
        assert server.wait(30) == 1
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)


def test_speculative_decoding_serves_the_plain_greedy_tokens_and_reports_its_counters(served):
    """serve with speculative_config (prompt lookup): greedy completions equal the plain
    server's, token for token; /metrics carries vLLM's spec_decode series."""
    plain_url, _, _ = served
    rng = np.random.default_rng(3)
    start = rng.integers(0, 512, 10).tolist()
    prompts = [start + dense_greedy([start], [30])[0][0], rng.integers(0, 512, 20).tolist()]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with running_server(engine_args={"speculative_config": spec}) as (url, _, engine):
        for prompt in prompts:
            kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=1)
            ours, plain = client(url).completions.create(**kwargs), client(plain_url).completions.create(**kwargs)
            assert ours.choices[0].text == plain.choices[0].text
            assert ours.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens
        stats = engine.get_stats()
        assert stats["spec_num_draft_tokens"] > 0
        wait_idle(engine, url)
        assert metric_value(url, "vllm:spec_decode_num_draft_tokens") == stats["spec_num_draft_tokens"]
        assert metric_value(url, "vllm:spec_decode_num_accepted_tokens") == stats["spec_num_accepted_tokens"]
        assert metric_value(url, "vllm:spec_decode_acceptance_rate_per_pos") == pytest.approx(
            stats["spec_acceptance_rate_per_position"][0])
