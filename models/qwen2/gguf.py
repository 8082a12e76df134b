"""GGUF (llama.cpp) Qwen2 checkpoints -> Qwen2Config and Qwen2ForCausalLM, and the reader the
Qwen3 family shares (models/qwen3/gguf.py).

llama.cpp's converter (convert_hf_to_gguf.py, Qwen2Model / Qwen3Model) writes the config
under `<arch>.*` keys with llama's meanings and Llama's tensor names plus the family's own
(`blk.{i}.attn_q.bias` here, `attn_q_norm` in Qwen3). It does not permute attn_q / attn_k
rows (llama.cpp runs these architectures with NEOX, i.e. rotate_half, RoPE), so every GGUF
tensor is the HF tensor of the same name map, handed to the family's model_from_hf_tensors.
weight_dtype as models/llama/gguf.py: "auto" keeps Q8_0 / Q4_1 / Q4_0 / BF16 matrices packed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from models.gguf import PackedRows, dequantize, get_float, get_metadata, open_gguf, packed_rows, require_metadata
from models.llama.gguf import BLOCK_TENSORS as LLAMA_BLOCK_TENSORS
from models.llama.gguf import GLOBAL_TENSORS
from models.packed_weight import pack_model
from models.qwen2.config import Qwen2Config
from models.qwen2.hf import model_from_hf_tensors
from models.qwen2.model import Qwen2ForCausalLM

__all__ = ["GGUF_ARCHITECTURES", "gguf_config_fields", "load_gguf_checkpoint", "read_gguf_config",
           "read_gguf_tensors", "tensor_getter"]

GGUF_ARCHITECTURES = ("qwen2",)

# Block tensors: "<GGUF key>.<weight|bias>" -> the HF name under model.layers.{i}.
LLAMA_BLOCKS: Mapping[str, str] = {f"{g}.weight": f"{hf}.weight" for g, hf in LLAMA_BLOCK_TENSORS.items()}
QWEN2_BLOCKS: Mapping[str, str] = {**LLAMA_BLOCKS, **{f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}}


def gguf_config_fields(reader, name: str, arch: str, *, dtype=None, param_dtype=None,
                       sliding_window_ok: bool = False) -> dict:
    """The LlamaConfig fields an `arch` GGUF's metadata (`<arch>.*`, llama's meanings) gives.

    sliding_window_ok: the family reads `<arch>.attention.sliding_window` itself (Gemma 3); else
    a window shorter than the context is refused.

    Raises:
      ValueError naming the key for missing metadata, RoPE scaling, partial rotary dims or an
      unknown vocabulary size.
    """
    def key(k):
        return f"{arch}.{k}"

    hidden = int(require_metadata(reader, key("embedding_length"), name))
    num_heads = int(require_metadata(reader, key("attention.head_count"), name))
    head_dim = int(get_metadata(reader, key("attention.key_length")) or hidden // num_heads)
    rope_dim = get_metadata(reader, key("rope.dimension_count"))
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"{name}: {key('rope.dimension_count')}={rope_dim} differs from head_dim={head_dim}; "
                         "partial rotary embeddings are not supported")
    scaling = get_metadata(reader, key("rope.scaling.type"), "none")
    if scaling != "none":
        raise ValueError(f"{name}: {key('rope.scaling.type')}={scaling!r} is not supported; supported: ['none']")
    window = get_metadata(reader, key("attention.sliding_window"))
    context = int(get_metadata(reader, key("context_length"), 2048))
    if window and int(window) < context and not sliding_window_ok:
        raise ValueError(f"{name}: {key('attention.sliding_window')}={window} is shorter than the context "
                         f"({context}): sliding-window attention is not supported yet")
    tensors = {t.name: t for t in reader.tensors}
    vocab = get_metadata(reader, key("vocab_size"))
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embd = tensors.get("token_embd.weight")
        vocab = len(tokens.data) if tokens is not None else int(embd.shape[-1]) if embd is not None else None
    if vocab is None:
        raise ValueError(f"{name} has neither {key('vocab_size')}, tokenizer.ggml.tokens nor token_embd.weight; "
                         "the vocabulary size is unknown")
    eos = get_metadata(reader, "tokenizer.ggml.eos_token_id")
    param_dtype = param_dtype if param_dtype is not None else "float32"
    return dict(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(require_metadata(reader, key("feed_forward_length"), name)),
        num_layers=int(require_metadata(reader, key("block_count"), name)),
        num_heads=num_heads, num_kv_heads=int(get_metadata(reader, key("attention.head_count_kv"), num_heads)),
        head_dim=head_dim, rms_norm_eps=get_float(reader, key("attention.layer_norm_rms_epsilon"), 1e-6),
        rope_theta=get_float(reader, key("rope.freq_base"), 10000.0), max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=get_metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        param_dtype=param_dtype, dtype=dtype if dtype is not None else param_dtype)


def read_gguf_tensors(reader, name: str, blocks: Mapping[str, str], family: str) -> dict:
    """HF tensor name -> GGUF tensor of every tensor in the file (ValueError naming one with no place)."""
    by_hf = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if tensor.name in GLOBAL_TENSORS:
            by_hf[GLOBAL_TENSORS[tensor.name]] = tensor
        elif len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and ".".join(parts[2:]) in blocks:
            by_hf[f"model.layers.{int(parts[1])}.{blocks['.'.join(parts[2:])]}"] = tensor
        else:
            raise ValueError(f"{name}: tensor {tensor.name} has no place in a {family} model (another "
                             "architecture?)")
    return by_hf


def tensor_getter(by_hf: dict, name: str, keep_packed: bool) -> Callable[[str], np.ndarray | PackedRows]:
    """get_tensor(HF name) over read_gguf_tensors' map: a 2-D tensor's own blocks when keep_packed
    and packed_rows reads its type, else float32 (KeyError for a name the file lacks)."""

    def get_tensor(hf_name: str) -> np.ndarray | PackedRows:
        tensor = by_hf[hf_name]
        packed = packed_rows(tensor) if keep_packed else None
        return packed if packed is not None else dequantize(tensor, name)

    return get_tensor


def check_weight_dtype(weight_dtype: str, place) -> None:
    if weight_dtype == "auto" and place is not None:
        raise ValueError("a tensor-parallel mesh splits float weights only: load the GGUF with weight_dtype='float32'")


def read_gguf_config(reader_or_path, dtype=None, param_dtype=None) -> Qwen2Config:
    """The Qwen2Config a qwen2 GGUF's metadata describes (param_dtype defaults to "float32").

    Raises:
      ValueError naming the key for another architecture, missing metadata, RoPE scaling or
      a sliding window.
    """
    reader, name = open_gguf(reader_or_path)
    arch = get_metadata(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{name}: general.architecture={arch!r} is not a Qwen2 GGUF ({list(GGUF_ARCHITECTURES)})")
    return Qwen2Config(**gguf_config_fields(reader, name, arch, dtype=dtype, param_dtype=param_dtype))


def load_gguf_checkpoint(path, dtype=None, param_dtype=None, place=None,
                         weight_dtype: str = "auto") -> Qwen2ForCausalLM:
    """Load a qwen2 GGUF file as a Qwen2ForCausalLM (Args as models.llama.load_gguf_checkpoint).

    Raises:
      ValueError naming the file and the problem: a non-qwen2 architecture, a missing or
      unexpected tensor, a type gguf.quants cannot dequantize, a tensor of the wrong shape.
    """
    reader, name = open_gguf(path)
    config = read_gguf_config(reader, dtype=dtype, param_dtype=param_dtype)
    check_weight_dtype(weight_dtype, place)
    by_hf = read_gguf_tensors(reader, name, QWEN2_BLOCKS, "Qwen2")
    get_tensor = tensor_getter(by_hf, name, keep_packed=weight_dtype == "auto" and param_dtype is None)
    return pack_model(model_from_hf_tensors(config, get_tensor, place), weight_dtype)
