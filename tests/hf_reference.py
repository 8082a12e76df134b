"""What transformers computes, for the HF parity tests of every family: logits and a greedy
loop. torch is imported when called, so a module that imports these skips cleanly (with its
own importorskip) where torch is absent."""

from pathlib import Path

import numpy as np


def hf_logits(model, ids) -> np.ndarray:
    """f32 logits [B, L, V] of transformers' model on token ids [B, L]."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def assert_close_rel(ours, ref, what: str, rel_tol: float = 1e-4) -> None:
    """max |ours - ref| / max |ref| <= rel_tol, with a message naming `what`."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= rel_tol, f"{what}: max |ours - transformers| / max |transformers| = {err:.2e}"


def hf_greedy(model, prompt, max_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt, token by token with an explicit
    attention mask (without one, generate masks prompt tokens equal to pad_token_id)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.as_tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_from_gguf(path: Path, loader: str = "model"):
    """transformers' AutoModelForCausalLM (float32, eval) or AutoTokenizer read from a GGUF.

    transformers opens the file with gguf.GGUFReader once per call (twice for a model: config,
    then weights), ~30 s each on a 262k-token vocabulary: while it loads, GGUFReader hands it
    the reader models.gguf already parsed (the gguf package's own object, read-only), the same
    bytes through the same parser."""
    import gguf
    import pytest
    import torch
    import transformers

    from models.gguf import open_gguf

    path = Path(path)
    reader, _ = open_gguf(path)
    parse = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", lambda file, *args, **kwargs: reader if Path(file) == path
                      else parse(file, *args, **kwargs))
        if loader == "tokenizer":
            return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
