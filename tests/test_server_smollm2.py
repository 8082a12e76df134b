"""Structured outputs and tool calling on SmolLM2-135M-Instruct through the server, with the
official `openai` client.

200 JSON-schema-constrained chat completions over five schemas (nested objects, enums,
arrays, numbers with bounds), half of them streamed, all parse and validate against their
schema (jsonschema, the reference); greedy unconstrained requests sent in the same batches
produce the tokens they produce alone. guided_choice answers are always one of the choices,
and a tool round trip (tool_choice="required", the call parsed into tool_calls, the tool's
result sent back, a final answer) runs end to end.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig
from paged_jax.server import make_server
from paged_jax.tool_calls import HERMES_TEMPLATE
from test_server import TIMEOUT, client, serving, wait_idle

openai = pytest.importorskip("openai", reason="the server tests drive the official openai client")
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"

SCHEMAS = {
    "a person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 24}}, "required": ["name", "age"], "additionalProperties": False},
    "a city and where it lies": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "location": {"type": "object", "properties": {
            # multipleOf bounds the digits (a sampled number can run on to max_tokens), in
            # binary fractions so that jsonschema's float check is exact
            "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.25},
            "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.25}},
                     "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "location"], "additionalProperties": False},
    "the sentiment of 'I loved this film'": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125}},
        "required": ["sentiment", "confidence"], "additionalProperties": False},
    "tags for a blog post about Python": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "a shopping list": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"item": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["item", "qty"], "additionalProperties": False}},
}
REPEATS = 40  # x 5 schemas = 200 constrained completions
FREE = ["Write a haiku about the sea.", "What is the capital of France?", "List three prime numbers.",
        "Explain what a CPU cache is.", "Say hello in Spanish.", "Why is the sky blue?",
        "Name a famous painter.", "What does HTTP stand for?"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served():
    config = EngineConfig(model=MODEL, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512,
                          warm_up="none")
    engine = LLMEngine(config)
    try:
        with serving(make_server(engine, model_name=MODEL, chat_template=HERMES_TEMPLATE.read_text())) as (url, _):
            yield url, engine
    finally:
        engine.shutdown()


async def _chat(c, semaphore, stream: bool, **request) -> tuple[str, list[int], str]:
    """(text, token ids, finish_reason) of one chat completion."""
    async with semaphore:
        request["extra_body"] = request.get("extra_body", {}) | {"return_token_ids": True}
        if not stream:
            choice = (await c.chat.completions.create(**request)).choices[0]
            return choice.message.content, choice.model_extra["token_ids"], choice.finish_reason
        text, ids, finish = "", [], None
        async for event in await c.chat.completions.create(stream=True, **request):
            if event.choices:
                text += event.choices[0].delta.content or ""
                ids += event.choices[0].model_extra["token_ids"]
                finish = event.choices[0].finish_reason or finish
        return text, ids, finish


def free_request(prompt: str) -> dict:
    return dict(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=32)


def test_200_json_schema_completions_validate_beside_unchanged_free_ones(served):
    url, engine = served

    async def run():
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT * 10, max_retries=0)
        semaphore = asyncio.Semaphore(32)
        alone = await asyncio.gather(*(_chat(c, semaphore, False, **free_request(p)) for p in FREE))
        guided, free = [], []
        for i in range(REPEATS):
            for what, schema in SCHEMAS.items():
                request = dict(model=MODEL, messages=[{"role": "user", "content": f"Give {what} as JSON."}],
                               temperature=0.8, seed=len(guided), max_tokens=160,
                               response_format={"type": "json_schema",
                                                "json_schema": {"name": "answer", "schema": schema, "strict": True}})
                guided.append((schema, _chat(c, semaphore, len(guided) % 2 == 1, **request)))
            if i % 5 == 0:  # free requests among the constrained ones, in every few batches
                free.append(_chat(c, semaphore, i % 10 == 5, **free_request(FREE[(i // 5) % len(FREE)])))
        results = await asyncio.gather(*(coro for _, coro in guided), *free)
        await c.close()
        return alone, [schema for schema, _ in guided], results[:len(guided)], results[len(guided):]

    alone, schemas, guided, free = asyncio.run(run())
    assert len(guided) == 200
    for schema, (text, _, finish) in zip(schemas, guided):
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), schema)
    for i, (_, ids, _) in enumerate(free):
        assert ids == alone[i % len(FREE)][1], f"free request {i} changed beside constrained ones"
    wait_idle(engine, url)
    engine.kv_cache_manager.check_invariants()


def test_guided_choice_is_always_a_choice(served):
    url, _ = served
    c = client(url)
    choices = ["Paris", "London", "Berlin", "Madrid"]
    for seed in range(8):
        out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A European capital?"}],
                                        temperature=1.0, seed=seed, max_tokens=16,
                                        extra_body={"guided_choice": choices})
        assert out.choices[0].message.content in choices


def test_tool_calling_round_trip(served):
    url, _ = served
    c = client(url)
    messages = [{"role": "user", "content": "What is the weather like in Paris today? Use celsius."}]
    first = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                      temperature=0, max_tokens=96)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather"
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    messages += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    final = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=64)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls, answer
    assert answer.message.content and answer.message.content.strip(), answer
