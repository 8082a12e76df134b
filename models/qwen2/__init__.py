"""The Qwen2 family (Qwen2ForCausalLM: Qwen2, Qwen2.5): Llama's decoder with q/k/v biases.

One place for everything Qwen2-specific; models/registry.py holds its row.
- config.py: Qwen2Config (LlamaConfig's fields; presets, HF config.json reader) and the
  sliding-window check Qwen3 shares;
- model.py: the biased attention (Llama's with a _project of its own), the decoder layer
  and model, PARAM_PARTITION_RULES (Llama's, plus the biases split with their heads);
- hf.py: the HF tensor map (Llama's plus the biases) and loader;
- gguf.py: the qwen2 GGUF metadata reader and tensor names, shared with Qwen3.
"""

from models.qwen2.config import PRESETS, Qwen2Config
from models.qwen2.gguf import GGUF_ARCHITECTURES, load_gguf_checkpoint, read_gguf_config
from models.qwen2.hf import load_hf_checkpoint, model_from_hf_tensors
from models.qwen2.model import PARAM_PARTITION_RULES, Qwen2Attention, Qwen2ForCausalLM

__all__ = ["GGUF_ARCHITECTURES", "PARAM_PARTITION_RULES", "PRESETS", "Qwen2Attention", "Qwen2Config",
           "Qwen2ForCausalLM", "load_gguf_checkpoint", "load_hf_checkpoint", "model_from_hf_tensors",
           "read_gguf_config"]
