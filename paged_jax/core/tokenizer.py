"""Text <-> token ids through HF `tokenizers`, reading a model directory's tokenizer.json.

`Tokenizer.from_model("tiny")` loads the byte-level BPE that ships inside the package
(paged_jax/core/assets/tokenizer.json, built by scripts/build_tokenizer.py), so the default model
runs on a fresh machine without downloads. Imports no jax.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from paged_jax.core.chat_template import end_of_turn_token, render_chat_template

EMBEDDED_MODELS = ("tiny",)
# Names the common Llama-family tokenizers use, for directories without tokenizer_config.json.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


def _token_name(value) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _chat_template(value) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates (take "default")."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


class Tokenizer:
    """A thin wrapper with the few things the engine needs.

    Attributes:
      bos_token_id: id put in front of every encoding (None when the tokenizer has none).
      eos_token_id: the end-of-sequence id generation stops on (None when unknown).
      eos_token_ids: every id generation_config.json lists as a stop (Llama 3 instruct has
        several); always contains eos_token_id when it is set.
      vocab_size: number of ids, added/special tokens included.
      chat_template: the model's Jinja chat template (None when it has none).
      bos_token, eos_token: the special tokens' strings, as templates write them.
    """

    def __init__(self, hf_tokenizer: _HFTokenizer, config: dict | None = None, generation_config: dict | None = None):
        self._tok = hf_tokenizer
        config = config or {}
        generation_config = generation_config or {}
        self.bos_token_id = self._find_id(_token_name(config.get("bos_token")), _BOS_NAMES)
        self.eos_token_id = self._find_id(_token_name(config.get("eos_token")), _EOS_NAMES)
        extra = generation_config.get("eos_token_id")
        extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        if self.eos_token_id is None and extra:
            self.eos_token_id = int(extra[0])
        ids = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids = tuple(dict.fromkeys(ids + [int(i) for i in extra]))
        # BOS comes from the tokenizer.json post-processor (Llama 3; encode applies it) or from
        # an explicit add_bos_token=true (Llama 2 configs). A missing flag adds nothing, as in
        # transformers 5 (4.x's LlamaTokenizerFast defaulted to True; its checkpoints say so
        # explicitly anyway).
        self._add_bos = config.get("add_bos_token") is True and self.bos_token_id is not None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = None if self.bos_token_id is None else self._tok.id_to_token(self.bos_token_id)
        self.eos_token = None if self.eos_token_id is None else self._tok.id_to_token(self.eos_token_id)
        self.chat_template = _chat_template(config.get("chat_template"))

    def _find_id(self, configured: str | None, fallbacks: tuple[str, ...]) -> int | None:
        for name in ((configured,) if configured else ()) + fallbacks:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    @classmethod
    def from_model(cls, model: str | Path) -> "Tokenizer":
        """Loads the tokenizer of `model`: an embedded name ("tiny"), a model directory
        holding tokenizer.json (plus optional tokenizer_config.json, chat_template.jinja and
        generation_config.json), or a tokenizer.json file."""
        if isinstance(model, str) and model in EMBEDDED_MODELS:
            text = resources.files("paged_jax.core").joinpath("assets", "tokenizer.json").read_text(encoding="utf-8")
            return cls(_HFTokenizer.from_str(text))
        path = Path(model)
        if path.is_file():
            return cls(_HFTokenizer.from_file(str(path)))
        if not (path / "tokenizer.json").is_file():
            raise ValueError(
                f"no tokenizer.json in {str(path)!r}: pass a model directory that has one "
                f"(HF 'fast' tokenizer format) or one of the embedded models {EMBEDDED_MODELS}"
            )
        config = _read_json(path / "tokenizer_config.json")
        if (path / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it apart
            config["chat_template"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(_HFTokenizer.from_file(str(path / "tokenizer.json")), config,
                   _read_json(path / "generation_config.json"))

    @property
    def hf_tokenizer(self) -> _HFTokenizer:
        """The HF `tokenizers.Tokenizer` underneath (structured outputs build their token trie from it)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Returns the ids of `text`, starting with BOS when the tokenizer adds one
        (add_special_tokens=False: exactly the text's tokens, as for a rendered chat)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The conversation as the model's chat template renders it (transformers' apply_chat_template).

        Args:
          messages: list of {"role", "content"}, oldest first.
          add_generation_prompt: end with the header that opens the assistant's reply.
          chat_template: overrides the model's template.
          tools: OpenAI-style tool definitions, the template's `tools` variable.
        Raises:
          ValueError naming the problem: no template, a bad message, a template error.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template=<Jinja text> (or "
                             "--chat-template FILE), or use generate with a formatted prompt")
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)

    def end_of_turn_token_id(self, chat_template: str | None = None) -> int | None:
        """The id of the token a reply ends with under the chat template ("<|im_end|>" for
        ChatML), if the template writes a known one and the vocabulary has it."""
        token = end_of_turn_token(chat_template or self.chat_template or "")
        return None if token is None else self._tok.token_to_id(token)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        """Returns the text of `token_ids` (special tokens dropped unless asked for)."""
        return self._tok.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text of a growing token sequence, one step at a time, in O(new tokens) per step.

    Decoding token by token breaks multi-byte characters and byte-level BPE merges, so the
    last few tokens are decoded again with a little context (vLLM's prefix/read offsets):
    `push(ids)` returns the text that became final. A trailing "\ufffd" means a character
    is still incomplete, so it waits for the next token.
    """

    # Tokens of context decoded in front of the new ones, so a leading space or a merge
    # across the boundary renders as it does in the whole sequence.
    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens whose text has been returned

    def push(self, new_token_ids) -> str:
        """Adds tokens; returns the newly final text ("" while a character is incomplete)."""
        self.token_ids.extend(int(t) for t in new_token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """The text still held back when the sequence ends (an incomplete character decodes
        as "\ufffd", as in the whole decode)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset:self._read_offset], self._skip)
        full = decode(self.token_ids[self._prefix_offset:], self._skip)
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""
        # The next window starts CONTEXT tokens before the end of what is now returned.
        self._read_offset = len(self.token_ids)
        self._prefix_offset = max(self._read_offset - self.CONTEXT, 0)
        return full[len(prefix):]
