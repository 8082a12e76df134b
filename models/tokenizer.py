"""The tokenizer of a model= name, and a GGUF's tokenizer rebuilt from its metadata.

load_tokenizer resolves the names models.registry.load_model takes: the embedded "tiny"
and HF directories go to paged_jax.core.tokenizer.Tokenizer.from_model (tokenizer.json);
a named model or a .gguf file gets the tokenizer its GGUF carries (gguf_tokenizer), the
same for every family, since GGUF spells tokenizers in `tokenizer.ggml.*` keys whatever the
architecture.

Imports no jax (tests/test_registry.py checks it), so a process that only tokenizes (the
server's HTTP front end) stays light.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from models.gguf import get_metadata, open_gguf
from models.named_models import gguf_path
from paged_jax.core.tokenizer import Tokenizer

__all__ = ["GGUFTokenizerInfo", "gguf_tokenizer", "load_tokenizer", "read_gguf_tokenizer_info"]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# general.architecture values whose "llama" (SentencePiece) vocabulary is rebuilt as Gemma's.
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of the model `model=` names (the GGUF's own for GGUF and named models).

    Raises:
      ValueError naming the model for a missing file or directory, or the GGUF key
      (tokenizer.ggml.model / tokenizer.ggml.pre) a GGUF tokenizer cannot be rebuilt from.
    """
    gguf = gguf_path(model)
    return gguf_tokenizer(gguf) if gguf is not None else Tokenizer.from_model(model)


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerInfo:
    """What a GGUF says about its tokenizer beyond the vocabulary.

    Attributes:
      model: tokenizer.ggml.model ("gpt2" byte-level BPE, "llama" SentencePiece, ...).
      pre: tokenizer.ggml.pre, the pre-tokenizer (regex split) name ("default" when absent).
      bos_token, eos_token, pad_token: token strings (None when the file names no id).
      bos_token_id, eos_token_id, pad_token_id: their ids.
      add_bos_token: whether encoding prepends BOS (tokenizer.ggml.add_bos_token).
      chat_template: tokenizer.chat_template (None when absent).
    """

    model: str
    pre: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


def read_gguf_tokenizer_info(path_or_reader) -> GGUFTokenizerInfo:
    """The tokenizer metadata of a GGUF (see GGUFTokenizerInfo); no vocabulary is built."""
    reader, name = open_gguf(path_or_reader)
    tokens = get_metadata(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{name} has no tokenizer.ggml.tokens; it carries no tokenizer")
    model = get_metadata(reader, "tokenizer.ggml.model", "")
    ids = {key: get_metadata(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding")}
    for key, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(f"{name}: tokenizer.ggml.{key}_token_id={token_id} is outside the "
                             f"{len(tokens)}-token vocabulary")
    text = {key: None if token_id is None else tokens[token_id] for key, token_id in ids.items()}
    # llama.cpp adds BOS to SentencePiece vocabularies unless told not to, never to byte-level BPE.
    add_bos = bool(get_metadata(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    return GGUFTokenizerInfo(model=model, pre=get_metadata(reader, "tokenizer.ggml.pre", "default"),
                             bos_token=text["bos"], eos_token=text["eos"], pad_token=text["padding"],
                             bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["padding"],
                             add_bos_token=add_bos, chat_template=get_metadata(reader, "tokenizer.chat_template"))


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


# tokenizer.ggml.pre -> the regex split in front of the byte-level step; None is the GPT-2 regex
# built into ByteLevel. Only names whose tokenization is checked against transformers' GGUF
# converter are listed. "smollm" is llama.cpp's GPT-2 regex with single digits; transformers
# applies the plain GPT-2 regex, and for SmolLM2's vocabulary (no merges join digits, or a
# space to a digit) both give the same ids.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZER_SPLITS = {"default": None, "gpt2": None, "gpt-2": None, "smollm": None,
                         "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}


def _byte_level_bpe(reader, name: str, info: GGUFTokenizerInfo):
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if info.pre not in _PRE_TOKENIZER_SPLITS:
        raise ValueError(f"{name}: tokenizer.ggml.pre={info.pre!r} is not supported; known pre-tokenizers "
                         f"are {sorted(_PRE_TOKENIZER_SPLITS)}")
    tokens = get_metadata(reader, "tokenizer.ggml.tokens")
    merges = get_metadata(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{name} has a gpt2 tokenizer without tokenizer.ggml.merges; the file is incomplete")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (a raw special token) is respelled byte by byte, as
    # transformers' GGUF converter does, so the BPE model accepts it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                                 continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS[info.pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # CONTROL tokens (and the named bos/eos/pad) stay whole and are special; a CONTROL token
    # outside the byte alphabet is a llama.cpp mislabel, skipped as transformers skips it.
    # USER_DEFINED tokens stay whole but are ordinary text.
    token_types = get_metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    named = {info.bos_token, info.eos_token, info.pad_token} - {None}
    special = [t for t, kind in zip(tokens, token_types) if (kind == _CONTROL or t in named) and set(t) <= alphabet]
    user = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tok


def _merges_by_position(vocab: dict[str, int], positions: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary without merges: every split of a token into two
    tokens, best-first by the token's score (here its negated position in the file), then the
    longer left piece (transformers' tokenization_utils_base.generate_merges, step for step)."""
    merges = []
    for token, score in positions.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _gemma_sentencepiece(reader, name: str, info: GGUFTokenizerInfo):
    """Gemma's SentencePiece vocabulary as the BPE transformers' GGUF converter builds for it
    (gguf_tokenizer_mapping.gemma_tokenizer + GemmaTokenizer): spaces normalized to U+2581, byte
    fallback (<0xNN> tokens), unknown pieces fused into <unk>, and merges rebuilt from the
    vocabulary in file order (Gemma's scores do not follow its merge order). A whitespace-only
    token with a space is stored with real spaces; it is respelled in U+2581 as the converter does."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t
              for t in get_metadata(reader, "tokenizer.ggml.tokens")]
    vocab = {t: i for i, t in enumerate(tokens)}
    positions = {t: -i for i, t in enumerate(tokens)}
    unk_id = get_metadata(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else "<unk>"
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=_merges_by_position(vocab, positions), dropout=None,
                                 unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # CONTROL tokens and the named ones (<unk>, <bos>, <eos>, <pad>, <mask>) stay whole and are
    # special; USER_DEFINED ones still in the vocabulary stay whole as ordinary text.
    token_types = get_metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    named = {unk, info.bos_token, info.eos_token, info.pad_token, "<mask>"} & set(vocab)
    special = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL or t in named]
    user = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tok


def gguf_tokenizer(path_or_reader):
    """The tokenizer a GGUF file carries, as a paged_jax.core.tokenizer.Tokenizer.

    Byte-level BPE ("gpt2") vocabularies, and the SentencePiece ("llama") vocabularies of the
    Gemma architectures, are rebuilt the way transformers' GGUF converter builds them (same ids
    for the same text). The chat template and pad id are in read_gguf_tokenizer_info.

    Args:
      path_or_reader: a .gguf path or an open gguf.GGUFReader.
    Returns:
      The Tokenizer (BOS added when tokenizer.ggml.add_bos_token says so, default False for gpt2,
      True for llama).
    Raises:
      ValueError naming tokenizer.ggml.model / tokenizer.ggml.pre when they are not supported.
    """
    reader, name = open_gguf(path_or_reader)
    info = read_gguf_tokenizer_info(reader)
    architecture = get_metadata(reader, "general.architecture")
    if info.model == "gpt2":
        hf_tokenizer = _byte_level_bpe(reader, name, info)
    elif info.model == "llama" and architecture in _GEMMA_ARCHITECTURES:
        hf_tokenizer = _gemma_sentencepiece(reader, name, info)
    else:
        raise ValueError(f"{name}: tokenizer.ggml.model={info.model!r} is not supported for general.architecture="
                         f"{architecture!r}; 'gpt2' (byte-level BPE) and the SentencePiece ('llama') vocabularies of "
                         f"{list(_GEMMA_ARCHITECTURES)} GGUF tokenizers are rebuilt. Use the model's HF "
                         "tokenizer.json with Tokenizer.from_model instead")
    eot = get_metadata(reader, "tokenizer.ggml.eot_token_id")
    config = {"bos_token": info.bos_token, "eos_token": info.eos_token, "add_bos_token": info.add_bos_token,
              "chat_template": info.chat_template}
    generation_config = {"eos_token_id": [i for i in (info.eos_token_id, eot) if i is not None] or None}
    return Tokenizer(hf_tokenizer, config, generation_config)
