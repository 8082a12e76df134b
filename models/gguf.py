"""GGUF (llama.cpp) Llama checkpoints -> LlamaConfig, LlamaForCausalLM and a Tokenizer.

The file is read with the `gguf` package (GGUFReader memory-maps it; gguf.quants.dequantize
expands every quantized type it implements to float32), never parsed by hand. Every GGUF
tensor is turned into the HF tensor of the same weight and handed to
models.loader.model_from_hf_tensors, so the two formats share one name -> parameter layout.

Three things differ from a HF directory:
- GGUF dims are listed fastest-first (ggml order); numpy order is the reverse, which for a
  2-D weight is HF's [out, in].
- llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) interleaves the two
  rotary halves of every attn_q / attn_k head for its RoPE kernel; load undoes it.
- Quantized weights dequantize to float32, so param_dtype defaults to "float32".
"""

from __future__ import annotations

import dataclasses
import math
import os
from functools import lru_cache

import numpy as np

from models.config import Llama3RopeScaling, LlamaConfig
from models.llama import LlamaForCausalLM
from models.loader import model_from_hf_tensors

__all__ = ["GGUFTokenizerInfo", "gguf_tokenizer", "load_gguf_checkpoint", "read_gguf_config",
           "read_gguf_tokenizer_info"]

_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
_BLOCK_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
                  "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# llama.cpp's encoding of llama3 RoPE scaling: per-frequency divisors, read into the config.
_ROPE_FREQS = "rope_freqs.weight"
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def _open(reader_or_path):
    """(GGUFReader, name for messages); ValueError naming the file when it cannot be read."""
    import gguf

    if isinstance(reader_or_path, gguf.GGUFReader):
        return reader_or_path, "the GGUF file"
    path = os.fspath(reader_or_path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist; pass the path of a .gguf file")
    stat = os.stat(path)
    return _read(path, stat.st_size, stat.st_mtime_ns), path


@lru_cache(maxsize=2)
def _read(path: str, size: int, mtime_ns: int):
    """One GGUFReader per file version (size and mtime are part of the key), shared by the
    model and its tokenizer: the reader parses every metadata field in Python on open (1.6 s
    for SmolLM2's 49k-token vocabulary and merges), and an LLM reads the file twice."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader raises ValueError, KeyError, IndexError... on bad bytes
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                         f"{type(error).__name__}: {error}") from error
    for tensor in reader.tensors:
        # A memmap slice past the end of the file is silently short.
        if tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"{path} is truncated: tensor {tensor.name} has {tensor.data.nbytes} of its "
                             f"{tensor.n_bytes} bytes; download the file again")
    return reader


def _meta(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float(reader, key: str, default: float) -> float:
    # GGUF stores config floats as float32; the shortest decimal that rounds to the same float32
    # is the value the converter was given (9.999999747e-06 -> 1e-05, as in config.json).
    field = reader.fields.get(key)
    if field is None:
        return float(default)
    return float(np.format_float_positional(np.float32(field.contents()), unique=True, trim="-"))


def _require(reader, key: str, name: str):
    value = _meta(reader, key)
    if value is None:
        raise ValueError(f"{name} has no {key!r} metadata; a llama GGUF needs it")
    return value


def _llama3_factors(scaling: Llama3RopeScaling, rope_theta: float, head_dim: int) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes for `scaling` (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    old = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(scaling.factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.asarray(factors, np.float32)


def _rope_scaling(reader, name: str, rope_theta: float, head_dim: int) -> Llama3RopeScaling | None:
    # llama.cpp spells llama3 scaling as a rope_freqs tensor; other scalings as rope.scaling.* keys.
    kind = _meta(reader, "llama.rope.scaling.type", "none")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if kind not in ("none", "llama3"):
        raise ValueError(f"{name}: llama.rope.scaling.type={kind!r} is not supported; only llama3 "
                         "scaling (or none) is implemented")
    if kind == "none" and freqs is None:
        return None
    scaling = Llama3RopeScaling(
        # rope_freqs holds 1 for short wavelengths and the factor itself for long ones.
        factor=_float(reader, "llama.rope.scaling.factor", 0) or (float(freqs.data.max()) if freqs is not None else 0),
        low_freq_factor=_float(reader, "llama.rope.scaling.low_freq_factor", 1.0),
        high_freq_factor=_float(reader, "llama.rope.scaling.high_freq_factor", 4.0),
        original_max_position_embeddings=int(_meta(reader, "llama.rope.scaling.original_context_length", 8192)))
    if freqs is not None and not np.allclose(np.asarray(freqs.data, np.float32),
                                             _llama3_factors(scaling, rope_theta, head_dim), rtol=1e-4):
        raise ValueError(f"{name}: {_ROPE_FREQS} is not llama3 scaling with {scaling}; other per-frequency "
                         "RoPE factors are not supported")
    return scaling


def read_gguf_config(reader_or_path, dtype=None, param_dtype=None) -> LlamaConfig:
    """The LlamaConfig a llama GGUF's metadata describes.

    Args:
      reader_or_path: a .gguf path or an open gguf.GGUFReader.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to "float32" (what GGUF quantized
        weights dequantize to).
    Returns:
      The config; tie_word_embeddings is True when the file has no output.weight.
    Raises:
      ValueError naming the key for a non-llama architecture, missing metadata or an
      unsupported RoPE scaling.
    """
    reader, name = _open(reader_or_path)
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{name}: general.architecture={arch!r} is not supported; only 'llama' GGUF files load")
    hidden = int(_require(reader, "llama.embedding_length", name))
    num_heads = int(_require(reader, "llama.attention.head_count", name))
    head_dim = _meta(reader, "llama.attention.key_length")
    rope_dim = _meta(reader, "llama.rope.dimension_count")
    head_dim = int(head_dim or rope_dim or hidden // num_heads)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"{name}: llama.rope.dimension_count={rope_dim} differs from head_dim={head_dim}; "
                         "partial rotary embeddings are not supported")
    tensors = {t.name: t for t in reader.tensors}
    vocab = _meta(reader, "llama.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embd = tensors.get("token_embd.weight")
        vocab = len(tokens.data) if tokens is not None else int(embd.shape[-1]) if embd is not None else None
    if vocab is None:
        raise ValueError(f"{name} has neither llama.vocab_size, tokenizer.ggml.tokens nor token_embd.weight; "
                         "the vocabulary size is unknown")
    rope_theta = _float(reader, "llama.rope.freq_base", 10000.0)
    eos = _meta(reader, "tokenizer.ggml.eos_token_id")
    param_dtype = param_dtype if param_dtype is not None else "float32"
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_require(reader, "llama.feed_forward_length", name)),
        num_layers=int(_require(reader, "llama.block_count", name)),
        num_heads=num_heads,
        num_kv_heads=int(_meta(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_float(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, name, rope_theta, head_dim),
        max_position_embeddings=int(_meta(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        param_dtype=param_dtype,
        dtype=dtype if dtype is not None else param_dtype,
    )


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSORS \
            and parts[3] == "weight":
        return f"model.layers.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}.weight"
    return None


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's LlamaModel.permute: rows of each head from (H/2, 2) back to (2, H/2).

    The converter maps HF's rotate_half layout (first half / second half of every head) to
    interleaved pairs with reshape(N, 2, H/2, D).swapaxes(1, 2); swapping back restores it.
    """
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_checkpoint(path, dtype=None, param_dtype=None, place=None) -> LlamaForCausalLM:
    """Load a llama GGUF file (any tensor type gguf.quants can dequantize) as a LlamaForCausalLM.

    Args:
      path: the .gguf file.
      dtype: compute dtype; defaults to param_dtype.
      param_dtype: storage dtype of the weights; defaults to "float32".
      place: where each tensor goes (models.loader.model_from_hf_tensors); default the default device.
    Returns:
      The model; its config is `model.config` (see read_gguf_config).
    Raises:
      ValueError naming the file and the problem for a truncated or corrupt file, a
      non-llama architecture, a missing or unexpected tensor, a tensor type gguf.quants
      cannot dequantize, or a tensor of the wrong shape.
    """
    import gguf

    reader, name = _open(path)
    config = read_gguf_config(reader, dtype=dtype, param_dtype=param_dtype)
    by_hf = {}
    for tensor in reader.tensors:
        hf = _hf_name(tensor.name)
        if hf is None and tensor.name != _ROPE_FREQS:
            raise ValueError(f"{name}: tensor {tensor.name} has no place in a Llama model (bias? another "
                             "architecture?); only llama GGUF files load")
        if hf is not None:
            by_hf[hf] = tensor
    num_layers = config.num_layers
    missing = [f"blk.{i}.{part}.weight" for i in range(num_layers) for part in _BLOCK_TENSORS
               if f"model.layers.{i}.{_BLOCK_TENSORS[part]}.weight" not in by_hf]
    missing += [g for g, hf in _GLOBAL_TENSORS.items() if hf not in by_hf and g != "output.weight"]
    if missing:
        raise ValueError(f"{name} is missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                         f"for a {num_layers}-layer llama")

    def get_tensor(hf_name: str) -> np.ndarray:
        tensor = by_hf[hf_name]
        try:
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise ValueError(f"{name}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                             f"gguf.quants cannot dequantize ({error}); re-quantize the file to a "
                             "supported type such as Q8_0 or F16") from error
        w = np.asarray(w, np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if hf_name.endswith("q_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_kv_heads)
        return w

    return model_from_hf_tensors(config, get_tensor, place)


# tokenizer

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
    reader, name = _open(path_or_reader)
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{name} has no tokenizer.ggml.tokens; it carries no tokenizer")
    model = _meta(reader, "tokenizer.ggml.model", "")
    ids = {key: _meta(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding")}
    for key, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(f"{name}: tokenizer.ggml.{key}_token_id={token_id} is outside the "
                             f"{len(tokens)}-token vocabulary")
    text = {key: None if token_id is None else tokens[token_id] for key, token_id in ids.items()}
    # llama.cpp adds BOS to SentencePiece vocabularies unless told not to, never to byte-level BPE.
    add_bos = bool(_meta(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    return GGUFTokenizerInfo(model=model, pre=_meta(reader, "tokenizer.ggml.pre", "default"),
                             bos_token=text["bos"], eos_token=text["eos"], pad_token=text["padding"],
                             bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["padding"],
                             add_bos_token=add_bos, chat_template=_meta(reader, "tokenizer.chat_template"))


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
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    merges = _meta(reader, "tokenizer.ggml.merges")
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
    token_types = _meta(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    named = {info.bos_token, info.eos_token, info.pad_token} - {None}
    special = [t for t, kind in zip(tokens, token_types) if (kind == _CONTROL or t in named) and set(t) <= alphabet]
    user = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tok


def gguf_tokenizer(path_or_reader):
    """The tokenizer a GGUF file carries, as a paged_jax.core.tokenizer.Tokenizer.

    Byte-level BPE ("gpt2") vocabularies are rebuilt the way transformers' GGUF converter
    builds them (same ids for the same text). The chat template and pad id are in
    read_gguf_tokenizer_info.

    Args:
      path_or_reader: a .gguf path or an open gguf.GGUFReader.
    Returns:
      The Tokenizer (BOS added when tokenizer.ggml.add_bos_token says so, default False for gpt2).
    Raises:
      ValueError naming tokenizer.ggml.model / tokenizer.ggml.pre when they are not supported.
    """
    from paged_jax.core.tokenizer import Tokenizer

    reader, name = _open(path_or_reader)
    info = read_gguf_tokenizer_info(reader)
    if info.model != "gpt2":
        raise ValueError(f"{name}: tokenizer.ggml.model={info.model!r} is not supported; only 'gpt2' "
                         "(byte-level BPE) GGUF tokenizers are rebuilt. Use the model's HF tokenizer.json "
                         "with Tokenizer.from_model instead")
    hf_tokenizer = _byte_level_bpe(reader, name, info)
    eot = _meta(reader, "tokenizer.ggml.eot_token_id")
    config = {"bos_token": info.bos_token, "eos_token": info.eos_token, "add_bos_token": info.add_bos_token,
              "chat_template": info.chat_template}
    generation_config = {"eos_token_id": [i for i in (info.eos_token_id, eot) if i is not None] or None}
    return Tokenizer(hf_tokenizer, config, generation_config)
