"""Bad input is a ValueError that says what to change, and it harms nobody else.

Each case starts a few good requests, runs two steps, submits the bad one mid-run, and
then checks that the good requests still finish with the dense reference's tokens and that
every block comes back.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine_reference import (
    MAX_MODEL_LEN,
    assert_no_leak,
    big_llm,
    dense_greedy,
    get_engine,
    greedy_params,
    make_prompts,
    run_to_completion,
)
from models.llama import LlamaConfig
from paged_jax import SamplingParams
from paged_jax.compile_cache import default_compile_cache_dir
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig

GOOD = "good-0"  # the id of an in-flight request (the duplicate-id case reuses it)

# (case, engine, (prompt, sampling-params kwargs) or a callable, regex the message must match)
BAD_REQUESTS = [
    ("empty prompt", "big", ([], {}), r"empty; give at least one token"),
    ("prompt longer than max_model_len", "big", ([5] * (MAX_MODEL_LEN + 1), {}),
     r"257 tokens, more than max_model_len=256; shorten the prompt or raise max_model_len"),
    ("token id = vocab size", "big", ([5, 512, 7], {}), r"\[512\] are outside the vocabulary \[0, 512\); tokenize"),
    ("negative token id", "big", ([-1, 5], {}), r"outside the vocabulary"),
    ("non-integer token id", "big", ([5, 6.5], {}), r"list of int token ids"),
    ("not a prompt", "big", (None, {}), r"must be a string or a list of int token ids"),
    ("max_tokens = 0", "big", ([5], dict(max_tokens=0)), r"max_tokens=0 must be an int >= 1; ask for at least one"),
    ("max_tokens < 0", "big", ([5], dict(max_tokens=-3)), r"max_tokens=-3 .* ask for at least one"),
    ("temperature < 0", "big", ([5], dict(temperature=-0.5)), r"temperature=-0.5 must be >= 0; use 0 for greedy"),
    ("top_p = 0", "big", ([5], dict(top_p=0.0)), r"top_p=0.0 must be in \(0, 1\]; use 1.0 to disable"),
    ("top_p > 1", "big", ([5], dict(top_p=1.5)), r"top_p=1.5 must be in \(0, 1\]"),
    ("top_k < -1", "big", ([5], dict(top_k=-2)), r"top_k=-2 must be an int >= 1, or -1 / 0 to disable"),
    # 200 + 40 - 1 slots = 15 blocks; the small pool has 11 (176 slots < max_model_len)
    ("never fits in the pool", "small_pool", ([5] * 200, dict(max_tokens=40)),
     r"may need 15 KV blocks .* whole pool has 11; lower max_tokens, shorten the prompt or give the cache more"),
    ("duplicate request id", "big", "duplicate", r"'good-0' is already in use; give each request a unique id"),
    ("sampling_params of the wrong type", "big", "dict_params", r"sampling_params must be a SamplingParams"),
]


@pytest.fixture(scope="module")
def good():
    prompts, max_tokens = make_prompts(seed=7, num=12)
    prompts, max_tokens = prompts[:5], [12, 3, 16, 8, 20]
    ref, _ = dense_greedy(prompts, max_tokens)
    return prompts, max_tokens, ref


@pytest.mark.parametrize("case,engine_name,bad,message", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_rejected_and_others_finish(case, engine_name, bad, message, good):
    prompts, max_tokens, ref = good
    engine = get_engine(engine_name)
    ids = [f"good-{i}" for i in range(len(prompts))]
    for request_id, p, m in zip(ids, prompts, max_tokens):
        engine.add_request(request_id, p, greedy_params(m))
    outputs = {}
    for _ in range(2):
        outputs.update({o.request_id: o for o in engine.step()})
    live = set(engine.scheduler.requests)
    free = engine.kv_cache_manager.get_num_free_blocks()

    with pytest.raises(ValueError, match=message):
        if bad == "duplicate":
            engine.add_request(GOOD, prompts[1], greedy_params(4))
        elif bad == "dict_params":
            engine.add_request("bad", [5, 6], {"max_tokens": 4})
        else:
            prompt, kwargs = bad
            engine.add_request("bad", prompt, SamplingParams(**{"ignore_eos": True, **kwargs}))

    # nothing was queued or allocated for the bad request
    assert set(engine.scheduler.requests) == live and "bad" not in engine.scheduler.requests
    assert engine.kv_cache_manager.get_num_free_blocks() == free
    finished = run_to_completion(engine)
    finished.update({k: v for k, v in outputs.items() if v.finished})
    assert [finished[i].token_ids for i in ids] == ref
    assert not engine.abort_request("bad")
    assert_no_leak(engine)


def test_generate_with_one_bad_prompt_queues_nothing(good):
    prompts, max_tokens, ref = good
    llm = big_llm()
    engine = llm.engine
    free = engine.kv_cache_manager.get_num_free_blocks()
    for bad_prompt, message in (([], r"^prompt 2: .*empty"), ([1, 600], r"^prompt 2: .*vocabulary"),
                                ([1.5], r"^prompt 2: .*int token ids")):
        batch = [prompts[0], prompts[1], bad_prompt, prompts[2]]
        with pytest.raises(ValueError, match=message):
            llm.generate(batch, greedy_params(4), use_tqdm=False)
        assert not engine.has_unfinished_requests()
        assert engine.kv_cache_manager.get_num_free_blocks() == free
    with pytest.raises(ValueError, match="pass one for all or one per prompt"):
        llm.generate(prompts[:3], [greedy_params(4)] * 2, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    # the LLM still serves afterwards
    outputs = llm.generate(prompts, [greedy_params(m) for m in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == ref
    assert_no_leak(engine)


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_size=24), r"block_size=24 must be a power of two"),
    (dict(max_num_seqs=0), r"max_num_seqs=0 must be >= 1"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens=0 must be >= 1"),
    (dict(max_model_len=0), r"max_model_len=0 must be >= 1"),
    (dict(num_blocks=1), r"num_blocks=1 must be >= 2: block 0 is the null block"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
    (dict(attention_impl="cuda"), r"attention_impl='cuda' must be one of \('xla', 'triton', 'pallas'\)"),
    (dict(dtype="float33"), r"dtype='float33' must be a float dtype"),
    (dict(dtype="int8"), r"dtype='int8' must be a float dtype"),
    (dict(warm_up="lazy"), r"warm_up='lazy' must be one of \('background', 'full', 'none'\)"),
    (dict(compile_cache_dir=""), r"compile_cache_dir='' must be a directory path, or None"),
    (dict(compile_cache_dir=__file__), r"compile_cache_dir=.* is a file; give a directory"),
    (dict(hash_seed=1.5), r"hash_seed=1.5 must be an int, a str or None"),  # before any model loads
])
def test_engine_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_engine_config_warm_up_and_compile_cache_defaults(monkeypatch, tmp_path):
    assert EngineConfig(dtype="bfloat16").dtype == "bfloat16"  # an ml_dtypes name numpy alone rejects
    assert EngineConfig().warm_up == "background"
    assert EngineConfig(warm_up=True).warm_up == "full" and EngineConfig(warm_up=False).warm_up == "none"
    assert EngineConfig(compile_cache_dir=None).compile_cache_dir is None
    # The default defers to a cache the user configured, else default_compile_cache_dir()
    # (tests/test_compile_cache.py enables both).
    assert EngineConfig().compile_cache_dir == "auto"
    monkeypatch.setenv("PAGED_JAX_COMPILE_CACHE_DIR", str(tmp_path / "moved"))
    assert default_compile_cache_dir() == str(tmp_path / "moved")
    monkeypatch.delenv("PAGED_JAX_COMPILE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compile_cache_dir() == str(tmp_path / "paged-jax" / "xla")


def test_max_model_len_beyond_the_model_is_rejected():
    base = big_llm().engine
    config: LlamaConfig = base.model.config
    too_long = config.max_position_embeddings + 1
    with pytest.raises(ValueError, match=rf"max_model_len={too_long} exceeds .*max_position_embeddings"):
        LLMEngine(EngineConfig(max_model_len=too_long, warm_up=False), model=base.model, tokenizer=base.tokenizer)


def test_kv_memory_budget_too_small_is_rejected():
    base = big_llm().engine
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=100 holds 0 blocks .* give at least"):
        LLMEngine(EngineConfig(kv_cache_memory_bytes=100, max_model_len=64, warm_up=False),
                  model=base.model, tokenizer=base.tokenizer)


def test_sampling_params_replace_revalidates():
    # a frozen, validated dataclass: dataclasses.replace cannot sneak a bad value past __post_init__
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(greedy_params(4), temperature=-1.0)


def test_config_names_the_attention_table_implementations():
    """engine_config repeats the names (importing paged_jax.attention loads jax): they must agree."""
    from paged_jax.attention.registry import ATTENTION_IMPLS
    from paged_jax.engine_config import ATTENTION_IMPLS as CONFIG_IMPLS

    assert CONFIG_IMPLS == ATTENTION_IMPLS
    for impl in ATTENTION_IMPLS:
        assert EngineConfig(attention_impl=impl).attention_impl == impl


def test_offload_config_is_resolved_once_from_the_offload_fields():
    import pickle

    from paged_jax.core.offload import OffloadConfig

    assert EngineConfig().offload_config is None
    config = EngineConfig(offload_host_bytes=1 << 20, offload_dtype="int8", offload_disk_dir="/tmp/tier", hash_seed=0,
                          offload_disk_bytes=1 << 30)
    assert config.offload_config == OffloadConfig(1 << 20, "int8", "/tmp/tier", 1 << 30)
    assert dataclasses.replace(config, offload_host_bytes=2 << 20).offload_config.host_bytes == 2 << 20
    assert pickle.loads(pickle.dumps(config)).offload_config == config.offload_config  # ProcessCore sends it
    with pytest.raises(ValueError, match="offload_disk_bytes=0 must be"):
        EngineConfig(offload_host_bytes=1 << 20, offload_disk_bytes=0)
    with pytest.raises(TypeError):
        EngineConfig(offload_config=OffloadConfig(1 << 20))  # resolved, not given
