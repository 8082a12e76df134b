"""Gemma 3 270M through the engine: sliding-window groups against transformers, past the window.

Prompts of 1,600+ tokens (three times the 512-token window) run through chunked prefill (256
tokens a step), prefix caching (a second prompt shares the first one's opening 1,200 tokens)
and preemption (a pool too small for two such requests at once); every greedy output must be
transformers' own, token for token (Gemma3ForCausalLM from the same GGUF, float32, its
KV-cached generate). The sliding groups must hold no more than their window's blocks.
"""

import importlib.util

import numpy as np
import pytest

from engine_reference import assert_no_leak
from models.named_models import resolve_named_model
from paged_jax import LLM, SamplingParams

pytestmark = [pytest.mark.hf, pytest.mark.slow]

GEMMA3 = "gemma-3-270m"
MAX_TOKENS = 8
NUM_DECODED = 640


@pytest.fixture(scope="module")
def gemma3_path():
    missing = [m for m in ("torch", "transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the Gemma 3 reference needs {missing}: pip install -e '.[hf]'")
    return resolve_named_model(GEMMA3)


def hf_generate(model, prompt: list[int], max_tokens: int) -> list[int]:
    import torch

    ids = torch.as_tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


def long_prompts(tokenizer) -> list[list[int]]:
    """Three prompts of 1,600 tokens of Python's help topics: the second shares the first's
    opening 1,200 tokens (75 blocks of 16), the third shares nothing."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text)
    assert len(ids) > 6000
    first = ids[:1600]
    second = ids[:1200] + ids[3000:3400]
    third = ids[:1] + ids[4000:5599]  # BOS, then other text
    return [first, second, third]


def test_long_prompts_equal_transformers_with_chunking_prefix_hits_and_preemption(gemma3_path):
    import torch
    import transformers

    llm = LLM(GEMMA3, dtype="float32", block_size=16, max_model_len=2048, max_num_seqs=2,
              max_num_batched_tokens=256, enable_prefix_caching=True, num_blocks=480, warm_up="none")
    prompts = long_prompts(llm.engine.tokenizer)
    groups = llm.engine.cache_config.kv_cache_groups
    assert [g.attention_type for g in groups] == ["sliding_window"] * 5 + ["full_attention"]
    assert {g.sliding_window for g in groups[:5]} == {512}

    torch.set_num_threads(1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gemma3_path.parent), gguf_file=gemma3_path.name,
                                                            dtype=torch.float32).eval()
    expected = [hf_generate(ref, p, MAX_TOKENS) for p in prompts]
    del ref

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # The first prompt alone; then the second, whose 1,200 shared tokens hit in every group.
    first = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    second = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    assert first.token_ids == expected[0]
    assert second.token_ids == expected[1]
    assert second.metrics.num_cached_tokens == 1200 - 1200 % 16
    # Both long prompts again with the third at once: 479 usable blocks hold one 1,600-token
    # request (100 blocks of the full group + up to 49 in each of 5 sliding groups) but not three.
    outputs = llm.generate([prompts[2], prompts[0], prompts[1]], params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [expected[2], expected[0], expected[1]]
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small for three long requests"
    assert_no_leak(llm.engine)
    llm.shutdown()


def test_a_long_generation_keeps_the_sliding_groups_within_their_window(gemma3_path):
    """640 tokens decoded (past the window and 33 blocks; tests/test_sliding_window_manager.py decodes
    4,096 through the manager alone): each sliding group never holds more than
    ceil(512 / 16) + 1 blocks, the full group every block."""
    llm = LLM(GEMMA3, dtype="float32", block_size=16, max_model_len=700, max_num_seqs=1,
              max_num_batched_tokens=64, enable_prefix_caching=False, warm_up="none")
    engine = llm.engine
    prompt = engine.tokenizer.encode("def fibonacci(n):")
    engine.add_request("long", prompt, SamplingParams(max_tokens=NUM_DECODED, temperature=0.0, ignore_eos=True))
    manager = engine.kv_cache_manager
    most = np.zeros(6, int)
    while engine.has_unfinished_requests():
        engine.step()
        tables = manager.get_block_ids("long")
        held = [sum(1 for b in table if b != 0) for table in tables]
        most = np.maximum(most, held) if any(tables) else most
    assert max(most[:5]) <= -(-512 // 16) + 1, most
    assert max(most[:5]) == -(-512 // 16) + 1, "the window never filled: the test would not see a leak"
    assert most[5] == -(-(len(prompt) + NUM_DECODED - 1) // 16)
    assert_no_leak(engine)
    llm.shutdown()
