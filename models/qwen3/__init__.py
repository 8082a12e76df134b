"""The Qwen3 family (Qwen3ForCausalLM): Llama's decoder with per-head q/k RMSNorms and its own head_dim.

One place for everything Qwen3-specific; models/registry.py holds its row.
- config.py: Qwen3Config (LlamaConfig's fields; presets, HF config.json reader);
- model.py: the q/k-normed attention (Llama's with a _project of its own), the decoder layer
  and model (Qwen3-MoE builds on them), PARAM_PARTITION_RULES (Llama's);
- hf.py: the HF tensor map (Llama's plus the norms) and loader;
- gguf.py: the qwen3 GGUF reader (Qwen2's, with Qwen3's tensor names).
"""

from models.qwen3.config import PRESETS, Qwen3Config
from models.qwen3.gguf import GGUF_ARCHITECTURES, load_gguf_checkpoint, read_gguf_config
from models.qwen3.hf import load_hf_checkpoint, model_from_hf_tensors
from models.qwen3.model import PARAM_PARTITION_RULES, Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM

__all__ = ["GGUF_ARCHITECTURES", "PARAM_PARTITION_RULES", "PRESETS", "Qwen3Attention", "Qwen3Config",
           "Qwen3DecoderLayer", "Qwen3ForCausalLM", "load_gguf_checkpoint", "load_hf_checkpoint",
           "model_from_hf_tensors", "read_gguf_config"]
