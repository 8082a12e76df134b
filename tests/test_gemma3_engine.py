"""Gemma 3 270M through the engine: sliding-window groups against transformers, past the window.

Prompts of 1,600 tokens (three times the 512-token window) run through chunked prefill (256 tokens a
step), prefix caching (a second prompt shares the first one's opening 1,200 tokens) and
preemption (a pool too small for two such requests at once); every greedy output must be
transformers' own, token for token (Gemma3ForCausalLM from the same GGUF, float32, its
KV-cached generate). While a request decodes past the window its sliding groups hold exactly
ceil(512 / 16) + 1 blocks at most, the full group every block.
"""

import importlib.util

import numpy as np
import pytest

from engine_reference import assert_no_leak
from hf_reference import hf_from_gguf
from models.named_models import resolve_named_model
from paged_jax import LLM, SamplingParams
from paged_jax.core.single_type_kv_cache_manager import max_blocks_per_request

pytestmark = [pytest.mark.hf, pytest.mark.slow]

GEMMA3 = "gemma-3-270m"
MAX_TOKENS = 8
BLOCK_SIZE = 16
CHUNK = 256
# One 1,600-token request holds at most 101 blocks of the full group and 49 in each of the five
# sliding groups (cdiv(512 + 256 - 2, 16) + 1), 346 in all: 479 usable blocks hold one, not two.
NUM_BLOCKS = 480


@pytest.fixture(scope="module")
def gemma3_path():
    missing = [m for m in ("torch", "transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the Gemma 3 reference needs {missing}: pip install -e '.[hf]'")
    return resolve_named_model(GEMMA3)


@pytest.fixture(scope="module")
def llm(gemma3_path):
    """One engine for the module (the GGUF is read and dequantized once)."""
    llm = LLM(GEMMA3, dtype="float32", block_size=BLOCK_SIZE, max_model_len=2048, max_num_seqs=2,
              max_num_batched_tokens=CHUNK, enable_prefix_caching=True, num_blocks=NUM_BLOCKS, warm_up="none")
    yield llm
    llm.shutdown()


def hf_generate(model, prompt: list[int], max_tokens: int) -> list[int]:
    import torch

    ids = torch.as_tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


def topic_ids(tokenizer) -> list[int]:
    """Python's help topics, tokenized (over 6,000 tokens)."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    assert len(ids) > 6000
    return ids


def long_prompts(ids: list[int]) -> list[list[int]]:
    """Three prompts of 1,600 tokens: the second shares the first's opening 1,200 tokens (75
    blocks of 16), the third shares nothing."""
    first = ids[:1600]
    second = ids[:1200] + ids[3000:3400]
    third = ids[:1] + ids[4000:5599]  # BOS, then other text
    return [first, second, third]


def test_long_prompts_equal_transformers_with_chunking_prefix_hits_and_preemption(llm, gemma3_path):
    import torch

    prompts = long_prompts(topic_ids(llm.engine.tokenizer))
    groups = llm.engine.cache_config.kv_cache_groups
    assert [g.attention_type for g in groups] == ["sliding_window"] * 5 + ["full_attention"]
    assert {g.sliding_window for g in groups[:5]} == {512}

    torch.set_num_threads(1)
    ref = hf_from_gguf(gemma3_path)
    expected = [hf_generate(ref, p, MAX_TOKENS) for p in prompts]
    del ref

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # The first prompt alone; then the second, whose 1,200 shared tokens hit in every group.
    first = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    second = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    assert first.token_ids == expected[0]
    assert second.token_ids == expected[1]
    assert second.metrics.num_cached_tokens == 1200
    # The third and the first at once: the pool holds one of them, so one is preempted.
    before = llm.engine.get_stats()["num_preemptions"]
    outputs = llm.generate([prompts[2], prompts[0]], params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [expected[2], expected[0]]
    assert llm.engine.get_stats()["num_preemptions"] > before, "the pool was meant to be too small for two"
    assert_no_leak(llm.engine)


def test_decoding_past_the_window_keeps_the_sliding_groups_within_it(llm):
    """A 560-token prompt, then 48 decode steps (tests/test_sliding_window_manager.py decodes
    4,096 through the manager alone): while decoding, each sliding group holds at most
    ceil(512 / 16) + 1 blocks and reaches that bound; while prefilling, at most what
    max_blocks_per_request allows for 256-token chunks; the full group holds every block."""
    engine = llm.engine
    prompt = topic_ids(engine.tokenizer)[:1] + topic_ids(engine.tokenizer)[5200:5759]
    num_decoded = 48
    engine.add_request("long", prompt, SamplingParams(max_tokens=num_decoded, temperature=0.0, ignore_eos=True))
    groups = engine.cache_config.kv_cache_groups
    prefill_bound = max_blocks_per_request(groups[0], BLOCK_SIZE, len(prompt) + num_decoded, CHUNK)
    manager = engine.kv_cache_manager
    most = {"prefill": np.zeros(6, int), "decode": np.zeros(6, int)}
    while engine.has_unfinished_requests():
        phase = "decode" if engine.scheduler.requests["long"].num_computed_tokens >= len(prompt) else "prefill"
        engine.step()
        tables = manager.get_block_ids("long")
        if any(tables):
            most[phase] = np.maximum(most[phase], [sum(1 for b in table if b != 0) for table in tables])
    window_bound = -(-512 // BLOCK_SIZE) + 1
    assert max(most["decode"][:5]) == window_bound, most
    assert max(most["prefill"][:5]) <= prefill_bound, most
    assert most["decode"][5] == -(-(len(prompt) + num_decoded - 1) // BLOCK_SIZE)
    assert_no_leak(engine)
