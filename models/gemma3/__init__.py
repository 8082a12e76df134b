"""The Gemma 3 family (Gemma3ForCausalLM, the text decoder): sliding-window and full-attention
layers, QK-norm, four (1 + weight) RMSNorms a layer, a GELU-tanh MLP, scaled tied embeddings.

One place for everything Gemma-3-specific; models/registry.py holds its row.
- config.py: Gemma3Config (LlamaConfig's fields plus the window, layer types, local RoPE base,
  query_pre_attn_scalar; presets, HF config.json reader);
- model.py: the attention (Qwen3's, with a window, RoPE and scale per layer), the decoder
  layer, the model (one KV-cache spec per layer, its window in it), PARAM_PARTITION_RULES;
- hf.py: the HF tensor map (Qwen3's plus the feed-forward norms) and loader;
- gguf.py: the gemma3 GGUF reader (Qwen2's, with Gemma's names and the norms' 1 taken off).
"""

from models.gemma3.config import PRESETS, Gemma3Config
from models.gemma3.gguf import GGUF_ARCHITECTURES, load_gguf_checkpoint, read_gguf_config
from models.gemma3.hf import load_hf_checkpoint, model_from_hf_tensors
from models.gemma3.model import (PARAM_PARTITION_RULES, Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM,
                                 Gemma3RMSNorm)

__all__ = ["GGUF_ARCHITECTURES", "PARAM_PARTITION_RULES", "PRESETS", "Gemma3Attention", "Gemma3Config",
           "Gemma3DecoderLayer", "Gemma3ForCausalLM", "Gemma3RMSNorm", "load_gguf_checkpoint", "load_hf_checkpoint",
           "model_from_hf_tensors", "read_gguf_config"]
