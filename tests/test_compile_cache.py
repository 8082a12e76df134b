"""jax's persistent compilation cache and the engine (paged_jax/compile_cache.py).

The setting is process-wide in jax, so every case runs in a fresh subprocess: a user's own
cache (JAX_COMPILATION_CACHE_DIR, or jax.config) is used as they configured it by a plain
LLM("tiny"); only an explicit compile_cache_dir that conflicts with it is a ValueError."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, **env) -> dict:
    """Runs `code` (which prints one JSON line last) with `env` added; returns that JSON."""
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR",)}
    environ.update(JAX_PLATFORMS="cpu", **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environ,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


ENGINE = "dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, warm_up='none')"


def test_a_plain_llm_uses_the_cache_the_user_configured_by_environment(tmp_path):
    user = tmp_path / "user-cache"
    code = f"""
import json, jax
from paged_jax import LLM
before = jax.config.jax_persistent_cache_min_compile_time_secs
llm = LLM("tiny", **{ENGINE})  # the default, compile_cache_dir="auto"
llm.generate([[5, 6, 7]], use_tqdm=False)
out = {{"dir": jax.config.jax_compilation_cache_dir, "min_time_kept": jax.config.jax_persistent_cache_min_compile_time_secs == before}}
try:
    LLM("tiny", compile_cache_dir={str(tmp_path / "other")!r}, **{ENGINE})
except ValueError as error:
    out["conflict"] = str(error)
LLM("tiny", compile_cache_dir={str(user)!r}, **{ENGINE})  # explicit and the same: fine
print(json.dumps(out))
"""
    r = _run(code, JAX_COMPILATION_CACHE_DIR=str(user), PAGED_JAX_COMPILE_CACHE_DIR=str(tmp_path / "ours"))
    assert r["dir"] == str(user) and r["min_time_kept"], "the user's cache and its thresholds are theirs"
    assert not (tmp_path / "ours").exists()
    assert f"compile_cache_dir='{tmp_path / 'other'}', but this process already caches compilations in" in r["conflict"]
    assert "pass that directory, 'auto' (the default: use it) or None" in r["conflict"]


def test_a_cache_set_through_jax_config_is_used_too(tmp_path):
    user = tmp_path / "configured"
    code = f"""
import json, jax
jax.config.update("jax_compilation_cache_dir", {str(user)!r})
from paged_jax import LLM
LLM("tiny", **{ENGINE})
print(json.dumps({{"dir": jax.config.jax_compilation_cache_dir}}))
"""
    assert _run(code, PAGED_JAX_COMPILE_CACHE_DIR=str(tmp_path / "ours"))["dir"] == str(user)
    assert not (tmp_path / "ours").exists()


def test_without_a_user_cache_the_engine_turns_on_its_own(tmp_path):
    ours = tmp_path / "ours"
    code = f"""
import json, jax
from paged_jax import LLM
LLM("tiny", **{ENGINE}).generate([[5, 6, 7]], use_tqdm=False)
first = jax.config.jax_compilation_cache_dir
LLM("tiny", **{ENGINE})  # a second engine of the process finds it configured and keeps it
print(json.dumps({{"dir": first, "again": jax.config.jax_compilation_cache_dir,
                   "min_time": jax.config.jax_persistent_cache_min_compile_time_secs}}))
"""
    r = _run(code, PAGED_JAX_COMPILE_CACHE_DIR=str(ours))
    assert r["dir"] == r["again"] == str(ours) and r["min_time"] == 0 and ours.is_dir()
    assert any(ours.iterdir()), "the step's executables should be on disk"


def test_off_leaves_jax_alone(tmp_path):
    code = f"""
import json, jax
from paged_jax import LLM
LLM("tiny", compile_cache_dir=None, **{ENGINE})
print(json.dumps({{"dir": jax.config.jax_compilation_cache_dir}}))
"""
    assert _run(code, PAGED_JAX_COMPILE_CACHE_DIR=str(tmp_path / "ours"))["dir"] in (None, "")
    assert not (tmp_path / "ours").exists()
