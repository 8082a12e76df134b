"""What transformers computes, for the HF parity tests of every family: logits and a greedy
loop. torch is imported when called, so a module that imports these skips cleanly (with its
own importorskip) where torch is absent."""

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
