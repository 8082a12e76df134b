"""The OpenAI surface real clients send: content parts and nulls, structured outputs, penalties,
tool calls, vLLM's extra routes, OpenAI-shaped errors on every status, a body limit, and an
OpenAPI schema that schemathesis finds true.

One server on the tests' tiny weights (test_server.running_server) with the Hermes-style
tool template; references are LLM.generate / the engine's own tokenizer, the chat template
rendered directly, and each grammar's own definition (jsonschema, re, the choices).
Requests the app must refuse before the engine go to an app over an engine that fails any
request it gets (starlette's TestClient, no engine at all).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from fastapi.testclient import TestClient

from engine_reference import MAX_MODEL_LEN, big_llm
from paged_jax.chat import chat_prompt
from paged_jax.core.request import SamplingParams
from paged_jax.server.app import build_app
from test_server import CHATML, MODEL, client, http, running_server
from paged_jax.tool_calls import HERMES_TEMPLATE

openai = pytest.importorskip("openai", reason="the server tests drive the official openai client")

TEMPLATE = HERMES_TEMPLATE.read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


SERVED_LEN = 1024  # the tool template's system prompt alone is ~600 of the tiny tokenizer's tokens


@pytest.fixture(scope="module")
def served():
    with running_server(chat_template=TEMPLATE, engine_args={"max_model_len": SERVED_LEN}) as handle:
        yield handle


def post(url, path, body) -> tuple[int, dict]:
    code, text = http(f"{url}{path}", json.dumps(body).encode(), {"content-type": "application/json"})
    return code, json.loads(text) if text else {}


def assert_error(code, body, status: int, param=None):
    assert code == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"], body
    if param is not None:
        assert error["param"] == param, body


def test_content_parts_nulls_and_tool_call_history(served):
    url, _, _ = served
    c = client(url)
    greedy = dict(model=MODEL, temperature=0, max_tokens=8)
    as_text = c.chat.completions.create(messages=[{"role": "user", "content": "Hi\nthere"}], **greedy)
    as_parts = c.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
        **greedy)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    # vLLM's benchmark client and others send explicit nulls: each means the default
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "logprobs", "top_logprobs", "stop", "seed",
                               "presence_penalty", "frequency_penalty", "stream_options", "response_format",
                               "tools", "tool_choice", "user", "logit_bias", "max_completion_tokens")}
    code, body = post(url, "/v1/chat/completions",
                      {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4} | nulls)
    assert code == 200 and body["usage"]["completion_tokens"] >= 1, body
    code, body = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4} | nulls
                      | {"echo": None, "best_of": None, "suffix": None})
    assert code == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
    # an assistant turn that called a tool (content null) and the tool's answer
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}]
    code, body = post(url, "/v1/chat/completions", {"model": MODEL, "messages": history, "max_tokens": 4,
                                                    "tools": [WEATHER]})
    assert code == 200, body
    code, body = post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]})
    assert_error(code, body, 400, "messages.0.content.1")
    assert "image_url" in body["error"]["message"]


def test_routes_vllm_clients_call(served):
    url, _, engine = served
    c = client(url)
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    code, body = post(url, "/tokenize", {"model": MODEL, "prompt": "The paged cache"})
    assert code == 200 and body["tokens"] == engine.tokenizer.encode("The paged cache"), body
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == SERVED_LEN
    messages = [{"role": "user", "content": "Hi"}]
    code, body = post(url, "/tokenize", {"messages": messages, "return_token_strs": True})
    expected, _ = chat_prompt(engine.tokenizer, engine.eos_token_ids, messages, chat_template=TEMPLATE)
    assert code == 200 and body["tokens"] == expected and len(body["token_strs"]) == len(expected), body
    code, body = post(url, "/detokenize", {"tokens": engine.tokenizer.encode("The paged cache",
                                                                             add_special_tokens=False)})
    assert code == 200 and body["prompt"] == "The paged cache", body
    assert_error(*post(url, "/detokenize", {"tokens": [-1]}), 400, "tokens")
    assert_error(*post(url, "/tokenize", {"prompt": "x", "model": "other"}), 404, "model")
    code, text = http(f"{url}/version")
    assert code == 200 and json.loads(text)["version"]
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(f"{url}/health", method="HEAD"), timeout=10) as response:
        assert response.status == 200 and response.read() == b""
    # every error is OpenAI's error object: no route, a wrong method, a body that is not JSON
    code, text = http(f"{url}/v1/nowhere")
    assert_error(code, json.loads(text), 404)
    code, text = http(f"{url}/v1/completions")  # GET
    assert_error(code, json.loads(text), 405)
    code, text = http(f"{url}/v1/completions", b"{not json", {"content-type": "application/json"})
    assert_error(code, json.loads(text), 400)


def test_openapi_documents_what_the_server_returns(served):
    url, _, _ = served
    schema = json.loads(http(f"{url}/openapi.json")[1])
    operations = {(path, method): op for path, ops in schema["paths"].items() for method, op in ops.items()}
    assert not [key for key, op in operations.items() if "422" in op["responses"]], "422 is never returned"
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = operations[(path, "post")]["responses"]
        assert {"200", "400", "401", "404", "413", "500", "503"} <= set(responses), (path, responses)
        assert "text/event-stream" in responses["200"]["content"]
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert operations[("/health", "get")]["responses"]["200"]["content"] == {}
    assert list(operations[("/metrics", "get")]["responses"]["200"]["content"]) == ["text/plain"]
    assert ("/health", "head") in operations and ("/v1/models/{model_id}", "get") in operations


def test_max_tokens_is_checked_against_the_context(served):
    url, _, _ = served
    for value in (100000, 2**63):
        code, body = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": value})
        assert_error(code, body, 400, "max_tokens")
        assert f"maximum context length is {SERVED_LEN}" in body["error"]["message"]
    code, body = post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                    "max_completion_tokens": SERVED_LEN})
    assert_error(code, body, 400, "max_completion_tokens")
    # null: to the end of the context (vLLM's rule), for completions as for chat
    code, body = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": None,
                                               "ignore_eos": True, "temperature": 0})
    assert code == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["usage"]["total_tokens"] == SERVED_LEN, body["usage"]


def test_streamed_text_offsets_run_through_the_whole_completion(served):
    url, _, _ = served
    c = client(url)
    request = dict(model=MODEL, prompt="The paged cache", temperature=0, max_tokens=12, logprobs=1,
                   extra_body={"ignore_eos": True})
    whole = c.completions.create(**request).choices[0]
    tokens, offsets = [], []
    for chunk in c.completions.create(stream=True, **request):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))] and offsets[-1] > 0


def test_penalties_are_applied_like_llm_generate(served):
    url, _, _ = served
    c = client(url)
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties)
    reference = big_llm().generate(["The paged cache"], params, use_tqdm=False)[0].outputs[0].token_ids
    plain = big_llm().generate(["The paged cache"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    assert reference != plain, "the penalties should change this greedy output"
    out = c.completions.create(model=MODEL, prompt="The paged cache", temperature=0, max_tokens=24,
                               presence_penalty=0.5, frequency_penalty=0.4,
                               extra_body={"repetition_penalty": 1.3, "ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == reference
    code, body = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 3})
    assert_error(code, body, 400, "presence_penalty")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"enum": ["S", "M", "L"]},
                                           "price": {"type": "integer", "minimum": 0, "maximum": 100},
                                           "tags": {"type": "array",
                                                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "maxItems": 3}},
          "required": ["name", "size", "price", "tags"], "additionalProperties": False}


def test_structured_outputs_through_every_spelling(served):
    url, _, _ = served
    c = client(url)
    sampled = dict(model=MODEL, max_tokens=96, temperature=1.0)
    messages = [{"role": "user", "content": "A product, as JSON"}]
    for seed in range(4):
        for stream in (False, True):
            fmt = {"type": "json_schema", "json_schema": {"name": "product", "schema": SCHEMA, "strict": True}}
            if stream:
                events = c.chat.completions.create(messages=messages, response_format=fmt, seed=seed, stream=True,
                                                   **sampled)
                text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
            else:
                text = c.chat.completions.create(messages=messages, response_format=fmt, seed=seed,
                                                 **sampled).choices[0].message.content
            jsonschema.validate(json.loads(text), SCHEMA)
    # any object: random weights may write a string past max_tokens; what ends, parses
    finished = 0
    for seed in range(4):
        choice = c.chat.completions.create(messages=messages, response_format={"type": "json_object"}, seed=seed,
                                           **sampled).choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            finished += 1
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    assert finished, "no json_object reply finished"
    choices = ["yes", "no", "maybe so"]
    for seed in range(6):
        out = c.completions.create(prompt="Answer:", seed=seed, extra_body={"guided_choice": choices}, **sampled)
        assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
    out = c.completions.create(prompt="Date:", seed=1, extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"},
                               **sampled)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", out.choices[0].text)
    out = c.completions.create(prompt="Say", seed=2, **sampled,
                               extra_body={"structured_outputs": {"grammar": 'start: "a" | "b" "c"'}})
    assert out.choices[0].text in ("a", "bc")
    for extra, param in (({"guided_regex": "(["}, "guided_regex"), ({"guided_json": {"type": "objectx"}}, "guided_json"),
                         ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
                         ({"response_format": {"type": "json_schema"}}, "response_format")):
        assert_error(*post(url, "/v1/completions", {"model": MODEL, "prompt": "x"} | extra), 400, param)


def test_tool_choice_required_and_named_are_calls_that_validate(served):
    url, _, _ = served
    c = client(url)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for seed, stream in ((0, False), (1, True)):
        # one call (parallel_tool_calls=False): random weights could add calls up to max_tokens
        request = dict(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required", seed=seed,
                       max_tokens=96, temperature=1.0, parallel_tool_calls=False)
        if stream:
            calls = {}
            finish = None
            for event in c.chat.completions.create(stream=True, **request):
                for call in event.choices[0].delta.tool_calls or ():
                    calls.setdefault(call.index, call)
                finish = event.choices[0].finish_reason or finish
            calls = [calls[i] for i in sorted(calls)]
        else:
            choice = c.chat.completions.create(**request).choices[0]
            calls, finish = choice.message.tool_calls, choice.finish_reason
        assert finish == "tool_calls" and calls, (finish, calls)
        assert len(calls) == 1
        for call in calls:
            assert call.function.name == "get_weather" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    named = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=96, seed=3,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    code, body = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": [WEATHER],
                                                    "tool_choice": {"type": "function", "function": {"name": "x"}}})
    assert_error(code, body, 400, "tool_choice")
    code, body = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": [WEATHER],
                                                    "tool_choice": "required", "guided_regex": "a"})
    assert_error(code, body, 400, "tool_choice")


class _NoEngine:
    """An AsyncEngine stand-in for requests that must never reach it."""

    def __init__(self):
        self.calls = 0

    async def add_request(self, *args):
        self.calls += 1
        raise AssertionError("this request should have been refused before the engine")

    def is_alive(self):
        return True

    def abort(self, request_id):
        pass


def app_without_engine(chat_template=CHATML, **kwargs):
    engine = big_llm().engine
    render = functools.partial(chat_prompt, engine.tokenizer, engine.eos_token_ids, chat_template=chat_template)
    no_engine = _NoEngine()
    app = build_app(no_engine, engine.tokenizer, model_name=MODEL, max_model_len=MAX_MODEL_LEN,
                    chat_prompt=lambda m, g, p, tools=None: render(m, add_generation_prompt=g, sampling_params=p,
                                                                    tools=tools), **kwargs)
    return TestClient(app), no_engine


def test_a_big_body_gets_413_without_reaching_the_engine():
    http_client, no_engine = app_without_engine()
    body = json.dumps({"model": MODEL, "prompt": "word " * 4_000_000}).encode()  # 20 MB
    start = time.perf_counter()
    response = http_client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == 413, response.text
    assert time.perf_counter() - start < 5
    chunked = http_client.post("/v1/completions", content=iter([body[:5_000_000], body[5_000_000:]]),
                               headers={"content-type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    small, _ = app_without_engine(max_body_bytes=1000)
    assert small.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 2000}).status_code == 413
    # a prompt that does not fit is a 400 from the HTTP process's own tokenization
    response = http_client.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 2000})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert no_engine.calls == 0


def test_tools_under_a_template_that_cannot_show_them_get_400():
    http_client, no_engine = app_without_engine(chat_template=CHATML)
    response = http_client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
    assert "--chat-template" in response.json()["error"]["message"] and no_engine.calls == 0


def test_schemathesis_finds_no_failure(served, tmp_path):
    """schemathesis (the test extra) against /openapi.json, a bounded number of examples per
    route. positive_data_acceptance is left out: the schema cannot say that a prompt must fit
    the context or name the served model."""
    url, _, engine = served
    checks = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
              "negative_data_rejection")
    st = Path(sys.executable).with_name("st")
    result = subprocess.run([str(st), "run", f"{url}/openapi.json", "--checks", checks, "--max-examples", "25",
                             "--workers", "1", "--seed", "1", "--request-timeout", "60", "--no-color"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    engine.kv_cache_manager.check_invariants()
