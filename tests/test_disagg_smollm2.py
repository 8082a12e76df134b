"""Disaggregated serving on SmolLM2-135M-Instruct: a producer server, a consumer server and
the proxy in front of them (each server an engine of its own, sharing the loaded weights;
the transfer crosses JAX's transfer server on 127.0.0.1 as between processes), against a
third server that prefills and decodes alone. Greedy chat answers, driven by the openai
client through the proxy, equal that server's token for token, while the consumer computes
one prompt token per request.
"""

from __future__ import annotations

import pytest

from models.registry import load_model, load_tokenizer
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig
from paged_jax.server import make_server
from paged_jax.server.proxy import make_proxy_app
from paged_jax.tool_calls import HERMES_TEMPLATE
from test_proxy import serving as serving_app
from test_server import serving

openai = pytest.importorskip("openai", reason="the server tests drive the official openai client")
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?", "List three prime numbers.",
           "Explain what a CPU cache is, in two sentences, for a student who has never heard of one.",
           "Say hello in Spanish.", "Why is the sky blue?", "Name a famous painter and one of their works.",
           "What does HTTP stand for, and what is it used for?"]


@pytest.fixture(scope="module")
def urls():
    model, tokenizer = load_model(MODEL), load_tokenizer(MODEL)
    args = dict(model=MODEL, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256, warm_up="none",
                hash_seed=11)
    engines = {role: LLMEngine(EngineConfig(**args, kv_role=role), model=model, tokenizer=tokenizer)
               for role in ("producer", "consumer")}
    engines["alone"] = LLMEngine(EngineConfig(**args), model=model, tokenizer=tokenizer)
    template = HERMES_TEMPLATE.read_text()
    try:
        with serving(make_server(engines["producer"], model_name=MODEL, chat_template=template)) as (producer, _), \
                serving(make_server(engines["consumer"], model_name=MODEL, chat_template=template)) as (consumer, _), \
                serving(make_server(engines["alone"], model_name=MODEL, chat_template=template)) as (alone, _), \
                serving_app(make_proxy_app([producer], [consumer], timeout=300)) as proxy:
            yield proxy, alone, engines
    finally:
        for engine in engines.values():
            engine.shutdown()


def answer(url: str, prompt: str, stream: bool) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)
    request = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=32,
                   extra_body={"return_token_ids": True})
    if not stream:
        return client.chat.completions.create(**request).choices[0].model_extra["token_ids"]
    ids = []
    for event in client.chat.completions.create(stream=True, **request):
        if event.choices:
            ids += event.choices[0].model_extra["token_ids"]
    return ids


def test_chat_through_producer_consumer_and_proxy_equals_one_engine(urls):
    proxy, alone, engines = urls
    for i, prompt in enumerate(PROMPTS):
        assert answer(proxy, prompt, stream=bool(i % 2)) == answer(alone, prompt, stream=False), prompt
    consumer = engines["consumer"].get_stats()
    assert consumer["num_remote_loads"] == len(PROMPTS) and consumer["num_remote_load_failures"] == 0
    assert consumer["num_prompt_tokens_computed"] == len(PROMPTS)  # each prompt's last token; the rest pulled
    producer = engines["producer"]
    assert producer.get_stats()["num_kv_offers"] == len(PROMPTS)
    assert producer.get_stats()["kv_transfer_blocks_sent"] == consumer["kv_transfer_blocks_received"]


def test_a_second_turn_pulls_only_what_the_consumers_cache_lacks(urls):
    proxy, alone, engines = urls
    consumer = engines["consumer"]
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", timeout=300, max_retries=0)
    first = [{"role": "user", "content": "Describe the water cycle for a ten year old, in a few sentences."}]
    reply = client.chat.completions.create(model=MODEL, messages=first, temperature=0, max_tokens=48)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "Now say it as a short poem."}]
    before = consumer.get_stats()
    request = dict(model=MODEL, messages=second, temperature=0, max_tokens=32, extra_body={"return_token_ids": True})
    through = client.chat.completions.create(**request)
    alone_client = openai.OpenAI(base_url=f"{alone}/v1", api_key="none", timeout=300, max_retries=0)
    assert through.choices[0].model_extra["token_ids"] == \
        alone_client.chat.completions.create(**request).choices[0].model_extra["token_ids"]
    after = consumer.get_stats()
    pulled = after["num_external_tokens"] - before["num_external_tokens"]
    # the first turn's prompt blocks were pulled (and cached) by the first request: only the rest comes now
    assert 0 < pulled < through.usage.prompt_tokens - 1 - 16
    assert after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"] == 1
