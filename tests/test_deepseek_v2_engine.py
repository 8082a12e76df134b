"""LLM(model=<DeepSeek-V2 directory>) serves MLA on the paged latent pool: greedy outputs equal
transformers' (a greedy loop over DeepseekV2ForCausalLM's full forward) while the pool is
small enough to preempt and half the prompts share a cached system prompt.

The model has a dense first layer and a MoE layer, compiled one layer a program, so the
runner runs two kinds of layer program (dense, MoE) in one step.
"""

import shutil
from importlib import resources

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="HF parity needs torch (pip install -e '.[hf]', the CPU build)")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers (pip install -e '.[hf]')")

from paged_jax import LLM, SamplingParams  # noqa: E402
from test_deepseek_v2 import hf_deepseek  # noqa: E402
from engine_reference import assert_no_leak  # noqa: E402
from hf_reference import hf_greedy  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

def test_greedy_equals_transformers_under_preemption_and_prefix_caching(tmp_path):
    ref = hf_deepseek(num_layers=2, seed=5)  # dense, MoE; token ids < 256 fit the tiny tokenizer
    ref.save_pretrained(tmp_path)
    shutil.copy(resources.files("paged_jax.core").joinpath("assets", "tokenizer.json"), tmp_path / "tokenizer.json")

    rng = np.random.default_rng(0)
    system = rng.integers(0, 256, 16).tolist()  # two full blocks of 8
    prompts, max_tokens = [], []
    for i, n in enumerate([5, 9, 23, 8, 40, 1, 17, 30]):
        suffix = rng.integers(0, 256, n).tolist()
        prompts.append(system + suffix if i % 2 else suffix)
        max_tokens.append(int(rng.integers(6, 13)))
    expected = [hf_greedy(ref, p, m) for p, m in zip(prompts, max_tokens)]

    # 11 usable blocks of 8 = 88 slots for 4 running sequences of up to 68 tokens: preempts.
    llm = LLM(str(tmp_path), block_size=8, num_blocks=12, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, layers_per_program=1, warm_up="full")
    assert llm.engine.runner.pool.specs[0].kv_lora_rank == 32
    assert len(llm.engine.runner.layer_groups(1).kinds) == 2, "a dense and a MoE layer program"
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                     for m in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small for every sequence at once"
    assert stats["prefix_cache_hits"] > 0 and any(o.metrics.num_cached_tokens >= 16 for o in outputs[1::2])
    assert_no_leak(llm.engine)
    # Both layer programs alias their donated latent caches (c_kv and k_rope) to their outputs:
    # updated in place. (This pool is tiny, so temporaries are not compared with it.)
    runner = llm.engine.runner
    for stats in runner.compiled_memory(*runner.bucket_shapes()[-1])["layers"]:
        assert stats.alias_size_in_bytes == runner.pool.kv_cache_bytes // 2
