"""Tool calling for the chat route: `tools` + `tool_choice` in, `tool_calls` out (vLLM's shape).

- The tools are rendered by the model's chat template (the `tools` variable transformers
  passes); a template that never reads `tools` cannot show them to the model, so a request
  with tools gets a ValueError (the server's 400) naming `--chat-template`. The package ships
  a Hermes-style ChatML template with tool support (HERMES_TEMPLATE).
- tool_choice "required" and a named function are guided (structured outputs): "required"
  writes a JSON array of {"name", "parameters"} objects, one of the tools each (vLLM's schema);
  a named function writes that function's arguments. Both always parse.
- tool_choice "auto" lets the model choose; its reply is parsed the way vLLM's Hermes parser
  does: each <tool_call>{"name": ..., "arguments": {...}}</tool_call> block is a call, the text
  around them the content. "none" renders the tools and parses nothing.
Imports no jax.
"""

from __future__ import annotations

import json
import re
import uuid
from importlib import resources

import jinja2
from jinja2 import meta

from paged_jax.core.request import GuidedDecodingParams

HERMES_TEMPLATE = resources.files("paged_jax.core").joinpath("assets/tool_chat_template_hermes.jinja")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def check_tools(tools) -> list[dict]:
    """The request's tools, checked: a list of {"type": "function", "function": {"name",
    "description"?, "parameters"?}}; ValueError naming the index and field otherwise."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}; only function "
                             f"tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function needs a non-empty 'name'")
        parameters = function.get("parameters", {"type": "object"})
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if function["name"] in names:
            raise ValueError(f"tools[{i}].function.name={function['name']!r} is given twice; names must be unique")
        names.add(function["name"])
    return tools


def template_reads_tools(template: str) -> bool:
    """Whether a chat template uses the `tools` variable (else it cannot show them)."""
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def check_tool_choice(tool_choice, tools) -> str | dict:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": one of the tools}}."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice={tool_choice!r} needs tools; give tools or drop tool_choice")
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name is None:
        raise ValueError(f"tool_choice={tool_choice!r} must be 'none', 'auto', 'required' or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}")
    if name not in {t["function"]["name"] for t in tools or ()}:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    return tool_choice


def tool_guidance(tools, tool_choice, parallel_tool_calls: bool = True) -> GuidedDecodingParams | None:
    """The grammar a tool_choice imposes: None for "none" / "auto" (free text); "required"
    allows one call, or with parallel_tool_calls (OpenAI's default) any number >= 1."""
    if tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return GuidedDecodingParams(json=schema)
    name = tool_choice["function"]["name"]
    return GuidedDecodingParams(json=next(_parameters(t) for t in tools if t["function"]["name"] == name))


def _call(name: str, arguments) -> dict:
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, tool_choice) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply under tool_choice (calls in the OpenAI shape, with ids).

    A guided reply that did not finish (cut by max_tokens) or an auto block that is not a
    JSON call stays content."""
    if tool_choice == "none":
        return text, []
    if tool_choice == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], c["parameters"]) for c in calls]
        except (ValueError, TypeError, KeyError):
            return text, []
    if isinstance(tool_choice, dict):
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(tool_choice["function"]["name"], text)]
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
            calls.append(_call(call["name"], call.get("arguments", {})))
        except (ValueError, TypeError, KeyError):
            return text, []  # vLLM's Hermes parser: a malformed call leaves the whole reply as content
    if not calls:
        return text, []
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls
