"""Disaggregated serving end to end: `serve --kv-role producer`, `serve --kv-role consumer`
and `python -m paged_jax proxy`, three processes on 127.0.0.1 (tiny model), against one
engine in this process that prefills and decodes alone.

- Greedy answers through the proxy equal the one engine's, streamed or not, chat or not;
  the consumer computes one prompt token per request (the rest is pulled), a prompt that
  partly hits the consumer's own prefix cache pulls only the missing blocks, and the
  producer's pool is idle again after every transfer (from its /metrics).
- Faults: a producer killed between the legs (the consumer prefills locally; the proxy
  falls back when the producer cannot take the prefill), a producer that hangs (SIGSTOP:
  the transfer never completes, the consumer gives up after --kv-transfer-timeout), and a
  consumer that is gone before it pulls (the producer's offer expires, its pool is idle).
Every wait is bounded; every process is killed on exit.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from models.registry import load_model, load_tokenizer
from paged_jax.core.request import SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig
from test_server_faults import START_TIMEOUT, Serve, engine_pid, http, metrics, wait_for

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
NODE = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        "--warm-up", "none", "--hash-seed", "7", "--num-blocks", "128"]
CHATML = Path(tempfile.mkdtemp(prefix="paged-jax-disagg-")) / "chatml.jinja"
CHATML.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node(Serve):
    """A serve subprocess of the tiny model with this test's engine flags."""

    def __init__(self, *extra: str):
        super().__init__(*NODE, "--chat-template", str(CHATML), *extra)


def producer_node(timeout: float = 30, kv_port: int | None = None) -> Node:
    return Node("--kv-role", "producer", "--kv-transfer-timeout", str(timeout), "--kv-port", str(kv_port or 0))


class Proxy:
    def __init__(self, prefill: str, decode: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "paged_jax", "proxy", "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
             "--prefill", prefill, "--decode", decode, "--timeout", "120"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ | {"JAX_PLATFORMS": "cpu"})
        wait_for(lambda: self.process.poll() is not None or _status(f"{self.url}/proxy/stats") == 200, 60)
        assert self.process.poll() is None, self.process.stderr.read()

    def stats(self) -> dict:
        return json.loads(http(f"{self.url}/proxy/stats")[1])

    def kill(self):
        self.process.kill()
        self.process.wait(30)


def _status(url):
    try:
        return http(url, timeout=5)[0]
    except OSError:
        return None


@contextlib.contextmanager
def running(*nodes):
    try:
        yield nodes
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):
                if node.process.poll() is None:
                    os.kill(node.process.pid, signal.SIGCONT)  # a stopped one must be able to die
            node.kill()


def complete(url: str, prompt_ids, max_tokens=12, kv_transfer_params=None, stream=False) -> dict:
    """A greedy /v1/completions on token ids: its token ids, text and kv_transfer_params."""
    body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "stream": stream}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    status, text = http(f"{url}/v1/completions", body, timeout=120)
    assert status == 200, text
    if not stream:
        answer = json.loads(text)
        return {"token_ids": answer["choices"][0]["token_ids"], "kv_transfer_params": answer["kv_transfer_params"]}
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return {"token_ids": [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]}


@pytest.fixture(scope="module")
def reference():
    engine = LLMEngine(EngineConfig(model="tiny", max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                                    max_num_batched_tokens=64, warm_up="none"),
                       model=load_model("tiny"), tokenizer=load_tokenizer("tiny"))

    def greedy(prompt_ids, max_tokens=12):
        engine.add_request(f"r{time.monotonic_ns()}", prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    return output.token_ids
    return greedy


def prompt(n: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(1, 500, n).tolist()


@pytest.fixture(scope="module")
def cluster():
    kv_port = free_port()
    with running(producer_node(kv_port=kv_port)) as (producer,):
        producer_url = producer.wait_serving()
        with running(Node("--kv-role", "consumer", "--kv-peers", f"127.0.0.1:{kv_port}")) as (consumer,):
            consumer_url = consumer.wait_serving()
            proxy = Proxy(producer_url, consumer_url)
            try:
                yield producer_url, consumer_url, proxy
            finally:
                proxy.kill()


def test_answers_through_the_proxy_equal_one_engines(cluster, reference):
    producer, consumer, proxy = cluster
    prompts = [prompt(n, seed) for seed, n in enumerate([3, 16, 40, 100, 200])]
    before = metrics(consumer)
    for i, ids in enumerate(prompts):
        got = complete(proxy.url, ids, stream=bool(i % 2))
        assert got["token_ids"] == reference(ids), f"prompt {i}"
    after = metrics(consumer)
    assert after["paged_jax:prompt_tokens_computed"] - before["paged_jax:prompt_tokens_computed"] == len(prompts)
    assert after["paged_jax:num_external_tokens"] - before["paged_jax:num_external_tokens"] == sum(
        len(p) - 1 for p in prompts)
    assert after["paged_jax:num_remote_load_failures"] == 0
    assert proxy.stats()["prefill_fallbacks"] == 0
    wait_for(lambda: metrics(producer)["paged_jax:num_kv_pinned_requests"] == 0, 30)
    assert metrics(producer)["vllm:kv_cache_usage_perc"] == 0.0


def test_chat_through_the_proxy_equals_the_consumer_alone(cluster):
    producer, consumer, proxy = cluster
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me about paged attention"}],
            "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    status, text = http(f"{proxy.url}/v1/chat/completions", body, timeout=120)
    assert status == 200, text
    through = json.loads(text)["choices"][0]["token_ids"]
    computed = metrics(consumer)["paged_jax:prompt_tokens_computed"]
    status, text = http(f"{producer}/v1/chat/completions", body, timeout=120)  # one engine, no transfer
    assert json.loads(text)["choices"][0]["token_ids"] == through
    assert metrics(consumer)["paged_jax:prompt_tokens_computed"] == computed


def test_a_partial_hit_in_the_consumers_cache_pulls_only_the_missing_blocks(cluster, reference):
    producer, consumer, proxy = cluster
    shared = prompt(64, 40)
    complete(consumer, shared + prompt(10, 41))  # straight to the consumer: caches 4 shared blocks
    first = shared + prompt(60, 42)
    before = metrics(consumer)
    assert complete(proxy.url, first)["token_ids"] == reference(first)
    after = metrics(consumer)
    assert after["paged_jax:num_external_tokens"] - before["paged_jax:num_external_tokens"] == len(first) - 1 - 64
    assert after["paged_jax:kv_transfer_bytes_received"] > before["paged_jax:kv_transfer_bytes_received"]
    assert after["paged_jax:prompt_tokens_computed"] - before["paged_jax:prompt_tokens_computed"] == 1


def test_a_producer_killed_between_the_legs_means_a_local_prefill(reference):
    with running(producer_node(), Node("--kv-role", "consumer", "--kv-transfer-timeout", "20")) as (producer, consumer):
        producer_url, consumer_url = producer.wait_serving(), consumer.wait_serving()
        ids = prompt(90, 50)
        offered = complete(producer_url, ids, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert offered["kv_transfer_params"]["do_remote_prefill"]
        producer.kill()
        got = complete(consumer_url, ids, kv_transfer_params=offered["kv_transfer_params"])
        assert got["token_ids"] == reference(ids)
        stats = metrics(consumer_url)
        assert stats["paged_jax:num_remote_load_failures"] == 1 and stats["paged_jax:num_remote_loads"] == 0
        assert stats["paged_jax:prompt_tokens_computed"] == len(ids)
        assert stats["vllm:kv_cache_usage_perc"] == 0.0
        proxy = Proxy(producer_url, consumer_url)  # the producer is gone: the proxy falls back
        try:
            assert complete(proxy.url, ids)["token_ids"] == reference(ids)
            assert proxy.stats()["prefill_fallbacks"] == 1
        finally:
            proxy.kill()


def test_a_hung_producer_times_out_into_a_local_prefill(reference):
    with running(producer_node(), Node("--kv-role", "consumer", "--kv-transfer-timeout", "3")) as (producer, consumer):
        producer_url, consumer_url = producer.wait_serving(), consumer.wait_serving()
        ids = prompt(70, 60)
        offered = complete(producer_url, ids, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        stopped = engine_pid(producer.process.pid)  # the engine process holds the side channel
        os.kill(stopped, signal.SIGSTOP)  # it accepts connections (the kernel does) and never answers
        try:
            start = time.time()
            got = complete(consumer_url, ids, kv_transfer_params=offered["kv_transfer_params"])
            assert time.time() - start < 60
            assert got["token_ids"] == reference(ids)
            assert metrics(consumer_url)["paged_jax:num_remote_load_failures"] == 1
        finally:
            os.kill(stopped, signal.SIGKILL)


def test_an_offer_no_consumer_pulls_expires_and_the_producers_pool_is_idle():
    with running(producer_node(timeout=2)) as (producer,):
        producer_url = producer.wait_serving()
        offered = complete(producer_url, prompt(120, 70), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert offered["kv_transfer_params"]["num_tokens"] == 120
        assert metrics(producer_url)["paged_jax:num_kv_pinned_requests"] == 1
        wait_for(lambda: metrics(producer_url)["paged_jax:num_kv_pinned_requests"] == 0, 30)
        stats = metrics(producer_url)
        assert stats["paged_jax:kv_transfer_offers_expired"] == 1 and stats["vllm:kv_cache_usage_perc"] == 0.0


def test_a_consumer_refuses_a_producer_whose_pages_differ():
    kv_port = free_port()
    with running(producer_node(kv_port=kv_port)) as (producer,):
        producer.wait_serving()  # its side channel listens: the consumer's start-up check reaches it
        consumer = Node("--kv-role", "consumer", "--kv-peers", f"127.0.0.1:{kv_port}", "--block-size", "8")
        deadline = time.time() + START_TIMEOUT
        while consumer.process.poll() is None:
            assert time.time() < deadline, consumer.output()
            time.sleep(0.2)
        consumer.wait_exit(30)
        assert consumer.process.returncode != 0
        assert "block_size: here 8, there 16" in consumer.output()
