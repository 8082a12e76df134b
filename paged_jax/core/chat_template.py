"""Chat messages -> prompt text through a model's Jinja chat template, as transformers renders it.

A chat template (tokenizer_config.json's or a GGUF's `tokenizer.chat_template`) is untrusted
code from the model's publisher, so it runs in Jinja's ImmutableSandboxedEnvironment with the
exact settings and helpers transformers' `apply_chat_template` gives it: trim_blocks,
lstrip_blocks, the loopcontrols extension, a no-op `{% generation %}` block,
`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, and the sandbox's
`dict` / `namespace` stand-ins. Rendering the same template and messages therefore gives the
same text, which is what the model was fine-tuned on. Imports no jax.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template", "end_of_turn_token", "validate_messages"]

# End-of-turn markers of the common template families, checked in this order; the first one the
# template writes is the token a chat reply ends with.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the tag to find assistant tokens (return_assistant_tokens_mask); templates
    that carry it must still parse here, and the text they render is the body.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes ('<' -> '\u003c'); templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    # `dict(...)` inside a template without exposing the dict type itself to attribute tricks.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore names on a namespace are a path to CPython internals; refuse them.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attribute {name!r} on a namespace")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Compiling costs milliseconds and a server renders the same template for every request.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def validate_messages(messages) -> list[dict]:
    """Checks a conversation and returns it as a fresh list of plain dicts.

    Args:
      messages: a list of {"role": str, "content": str} (other keys, such as "name" or
        "tool_calls", pass through to the template; an assistant turn with tool_calls may have
        content None).
    Returns:
      A list of new dicts (the template cannot change the caller's messages).
    Raises:
      ValueError naming the index and field of the first bad message.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role': str, 'content': str}} dicts, "
                         f"got {type(messages).__name__}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', "
                             f"got {type(message).__name__}")
        for field in ("role", "content"):
            if field == "content" and message.get("tool_calls") and message.get("content") is None:
                continue  # an assistant turn that only called tools (OpenAI sends content: null)
            if field not in message:
                raise ValueError(f"messages[{index}] has no {field!r}; every message needs 'role' and 'content'")
            if not isinstance(message[field], str):
                raise ValueError(f"messages[{index}][{field!r}] must be a str, got "
                                 f"{type(message[field]).__name__}")
        checked.append(dict(message))
    return checked


def render_chat_template(template: str, messages, *, add_generation_prompt: bool = True,
                         bos_token: str | None = None, eos_token: str | None = None, **extra) -> str:
    """Renders a conversation with a model's chat template, as transformers' apply_chat_template does.

    Args:
      template: the Jinja chat template text.
      messages: list of {"role": str, "content": str}, oldest first.
      add_generation_prompt: end with the header that opens the assistant's reply.
      bos_token, eos_token: the token strings templates may write (`{{ bos_token }}`).
      **extra: any other template variable (tools, documents, date strings, ...).
    Returns:
      The prompt text. Tokenize it without adding BOS again: a template that wants BOS writes it.
    Raises:
      ValueError for a bad message (naming its index and field) or when the template raises
      (raise_exception) or does not compile.
    """
    if not isinstance(template, str) or not template:
        raise ValueError("template must be a non-empty chat template string; this model has none, so "
                         "format the prompt yourself")
    messages = validate_messages(messages)
    try:
        # tools and documents are always defined (None when unused), as transformers passes them.
        context = {"tools": None, "documents": None, "bos_token": bos_token, "eos_token": eos_token, **extra}
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"the chat template failed: {error}") from error


def end_of_turn_token(template: str) -> str | None:
    """The token a reply ends with under `template` ("<|im_end|>" for ChatML), None if not obvious.

    Args:
      template: the Jinja chat template text.
    Returns:
      The first known end-of-turn marker the template writes, or None.
    """
    return next((token for token in _END_OF_TURN_TOKENS if token in template), None)
