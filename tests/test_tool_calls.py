"""Tool calling: the Hermes template renders tools and calls, each tool_choice's grammar
always yields calls that validate against the tool's schema (tiny random model, sampled),
and the Hermes-style parser reads auto replies as vLLM's does."""

from __future__ import annotations

import json

import jsonschema
import pytest

from paged_jax import SamplingParams
from paged_jax.chat import chat_prompt
from paged_jax.tool_calls import (HERMES_TEMPLATE, check_tool_choice, check_tools, parse_tool_calls,
                                  template_reads_tools, tool_guidance)
from tests.engine_reference import assert_no_leak, get_engine, run_to_completion

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999},
                                                                   "b": {"type": "integer", "maximum": 999}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_hermes_template_renders_tools_calls_and_results():
    template = HERMES_TEMPLATE.read_text()
    assert template_reads_tools(template)
    assert not template_reads_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    engine = get_engine("big")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    ids, _ = chat_prompt(engine.tokenizer, engine.eos_token_ids, messages, chat_template=template, tools=TOOLS)
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_bad_tools_and_choices_are_value_errors():
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        check_tools([{"type": "retrieval"}])
    with pytest.raises(ValueError, match="given twice"):
        check_tools([ADD, ADD])
    with pytest.raises(ValueError, match="not among the tools"):
        check_tool_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(ValueError, match="needs tools"):
        check_tool_choice("required", None)
    assert check_tool_choice(None, TOOLS) == "auto" and check_tool_choice(None, None) == "none"


def test_auto_replies_parse_like_hermes():
    reply = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
             '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    content, calls = parse_tool_calls(reply, "auto")
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls("no calls here", "auto") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>{not json</tool_call>", "auto") == ("<tool_call>{not json</tool_call>", [])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_guided_tool_choices_always_give_valid_calls(tool_choice):
    """A random model sampled at temperature 1: every reply parses into calls of known tools
    whose arguments validate against that tool's parameters."""
    engine = get_engine("big")
    guidance = tool_guidance(TOOLS, tool_choice, parallel_tool_calls=False)  # else a random model lists calls on
    for i in range(6):
        engine.add_request(f"t{i}", [4, 5, 6 + i], SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                                                                   guided_decoding=guidance))
    finished = run_to_completion(engine)
    for i in range(6):
        out = finished[f"t{i}"].outputs[0]
        assert out.finish_reason == "stop", out.text
        content, calls = parse_tool_calls(out.text, tool_choice)
        assert content is None and len(calls) == 1, out.text
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA_OF[name])
            if isinstance(tool_choice, dict):
                assert name == "add"
    assert_no_leak(engine)
