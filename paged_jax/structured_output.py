"""Structured outputs: a grammar per request, a token bitmask per step (vLLM's guided decoding).

A request whose SamplingParams carry a GuidedDecodingParams (a JSON schema, a regex, a list
of choices, a Lark or GBNF grammar, or "any JSON object") gets an llguidance matcher; before
each step that samples it, the matcher writes the set of tokens that keep the output inside
the grammar into a row of a bitmask (i32, 32 tokens a word), which the compiled sampler
applies to the logits (sampler.apply_token_bitmask); after the step the matcher consumes the
tokens the request kept. A finished grammar allows only EOS, so the request stops the way any
other does.

Speculative decoding: a verification step scores 1 + k positions of a sequence, and position
j's mask is the grammar's after the first j proposals. llguidance computes those masks by
advancing through the proposals and rolling back, so the matcher is always at the last
verified token; after the step it consumes only what the rejection sampler kept (a rejected
proposal is never consumed: the rollback vLLM does explicitly). A proposal the grammar
forbids gets probability 0 under the masked target and is rejected.

Why llguidance: vLLM's default, xgrammar, requires torch and triton to install; llguidance
(vLLM's "guidance" backend) needs nothing, computes a 49k-token mask in tens of microseconds
and handles all four of vLLM's grammar kinds. Compiled grammars are cached by their
GuidedDecodingParams (a request gets a copy of the cached matcher). Imports no jax.
"""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.numpy as llguidance_np
import numpy as np

from paged_jax.core.request import GuidedDecodingParams

# Grammars this many distinct specs deep stay compiled (a server sees a handful of schemas).
_GRAMMAR_CACHE_SIZE = 128


def grammar_text(params: GuidedDecodingParams) -> str:
    """The llguidance grammar of a GuidedDecodingParams (no tokenizer needed)."""
    options = {"whitespace_flexible": params.whitespace_flexible}
    if params.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=options)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF (converted to Lark)


def checked_grammar(params: GuidedDecodingParams, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The grammar text of `params`, validated (with a tokenizer, against its vocabulary too);
    ValueError naming what is wrong. Without a tokenizer it is cheap enough for the server's
    HTTP process to check each request before it reaches the engine."""
    try:
        grammar = grammar_text(params)
    except ValueError as e:
        raise ValueError(f"guided_decoding: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"guided_decoding: the grammar does not compile: {error}")
    return grammar


class StructuredOutputManager:
    """The matchers of the live guided requests, and the bitmasks they fill.

    Args:
      tokenizer: the engine's paged_jax Tokenizer (its HF tokenizer's JSON builds llguidance's).
      vocab_size: the model's logits width (>= the tokenizer's ids; the extra ids are never allowed).
      eos_token_ids: the ids that end a request; a finished grammar allows exactly these.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.eos_token_ids = list(eos_token_ids)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor = None
        self.num_grammar_compiles = 0

    @functools.cached_property
    def _lltokenizer(self) -> llguidance.LLTokenizer:
        if not self.eos_token_ids:
            raise ValueError("guided_decoding needs an EOS token to end the output: this model's tokenizer has none")
        return llguidance.LLTokenizer(self._tokenizer.hf_tokenizer.to_str(), n_vocab=self.vocab_size,
                                      eos_token=self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                      else self.eos_token_ids)

    @functools.lru_cache(maxsize=_GRAMMAR_CACHE_SIZE)  # noqa: B019 (one manager per engine)
    def _compiled(self, params: GuidedDecodingParams) -> llguidance.LLMatcher:
        grammar = checked_grammar(params, self._lltokenizer)
        matcher = llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"guided_decoding: the grammar does not compile: {matcher.get_error()}")
        self.num_grammar_compiles += 1
        return matcher

    def add(self, request_id: str, params: GuidedDecodingParams) -> None:
        """A matcher for a new request (ValueError for a grammar that does not compile)."""
        self._matchers[request_id] = self._compiled(params).deep_copy()

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def fill_bitmask(self, bitmask: np.ndarray, rows) -> None:
        """Writes each request's allowed tokens into its rows of bitmask (i32[R, num_words]).

        rows: (request_id, row, proposals) triples: the mask of the next token goes to row,
        and with proposals (speculative decoding) the mask after the first j of them to row + j
        (only up to the first proposal the grammar forbids; later rows keep what they hold).
        The matchers end where they started."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        with_drafts = [(self._matchers[r], row, list(drafts)) for r, row, drafts in rows if drafts]
        plain = [(self._matchers[r], row) for r, row, drafts in rows if not drafts]
        if plain:
            llguidance_np.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if with_drafts:
            llguidance_np.fill_next_token_bitmask_par_with_draft_tokens(self._executor, with_drafts, bitmask)

    def accept(self, request_id: str, token_ids) -> None:
        """Advances a request's matcher by the tokens it kept this step. A token the grammar
        forbids (only possible for an EOS a finished grammar already implied) is ignored."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        for token in token_ids:
            if matcher.is_stopped():
                return
            if not matcher.consume_token(int(token)):
                raise RuntimeError(f"request {request_id!r}: token {token} broke its grammar "
                                   f"({matcher.get_error()}); the bitmask should have forbidden it")
