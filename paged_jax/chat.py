"""A conversation as prompt ids and stop tokens: the one rendering the engine, LLM.chat and
the server's HTTP process (which holds only the tokenizer) share. Imports no jax."""

from __future__ import annotations

import dataclasses

from paged_jax.core.request import SamplingParams
from paged_jax.core.tokenizer import Tokenizer
from paged_jax.tool_calls import template_reads_tools


class ToolsUnsupportedError(ValueError):
    """The request has tools and the chat template cannot render them."""


def chat_prompt(tokenizer: Tokenizer, eos_token_ids, messages, *, add_generation_prompt: bool = True,
                chat_template: str | None = None, sampling_params: SamplingParams | None = None,
                tools: list[dict] | None = None) -> tuple[list[int], SamplingParams]:
    """A conversation as prompt ids (rendered with the chat template, no BOS added twice)
    and the sampling params that also stop at the template's end-of-turn token.

    Needs only the tokenizer and the engine's EOS ids, so a server process without the
    engine (server/engine_core.py) renders prompts the same way. `tools` (OpenAI tool
    definitions) is the template's `tools` variable; a template that never reads it cannot
    show them to the model, so tools under such a template are a ValueError. Raises
    ValueError naming the problem (no template, a bad message, a template error).
    """
    if tools:
        if not template_reads_tools(chat_template or tokenizer.chat_template or ""):
            raise ToolsUnsupportedError("this chat template does not render tools (it never reads `tools`); serve with "
                             "--chat-template FILE naming one that does (paged_jax.tool_calls.HERMES_TEMPLATE "
                             "is a ChatML one), or send the request without tools")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, tools=tools)
    params = sampling_params or SamplingParams()
    end_of_turn = tokenizer.end_of_turn_token_id(chat_template)
    stops = (*eos_token_ids, *params.stop_token_ids)
    if end_of_turn is not None and end_of_turn not in stops and not params.ignore_eos:
        # The reply ends with the turn even where the template's end differs from EOS.
        params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, end_of_turn))
    return tokenizer.encode(text, add_special_tokens=False), params

