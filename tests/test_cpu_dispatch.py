"""jax's CPU dispatch mode as the engine sets it (paged_jax/engine.py set_cpu_dispatch): only
while jax has no backend yet, and a user's JAX_CPU_ENABLE_ASYNC_DISPATCH stands unless the
config names a mode. Each case runs in a fresh process (jax reads the mode once per process)."""

import os
import subprocess
import sys

import pytest

ENV = "JAX_CPU_ENABLE_ASYNC_DISPATCH"
PRINT_MODE = "import jax; print(jax.config.read('jax_cpu_enable_async_dispatch'))"


def _mode(code: str, env_value: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if env_value is not None:
        env[ENV] = env_value
    out = subprocess.run([sys.executable, "-c", code + "\n" + PRINT_MODE], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("setting,env_value,expected", [
    (None, None, "False"),    # the default: inline
    (None, "1", "True"),      # the user's environment stands
    (True, None, "True"),     # jax's dispatch thread, asked for
    (False, "1", "False"),    # a mode the config names wins over the environment
])
def test_set_before_jax_starts(setting, env_value, expected):
    assert _mode(f"from paged_jax.engine import set_cpu_dispatch; set_cpu_dispatch({setting})", env_value) == expected


def test_left_alone_once_a_backend_exists():
    # jax's default (True) stays: the client already made runs asynchronously whatever the
    # flag said afterwards, and the flag must not claim otherwise.
    code = "import jax; jax.devices(); from paged_jax.engine import set_cpu_dispatch; set_cpu_dispatch(False)"
    assert _mode(code) == "True"


def test_the_engine_runs_inline_by_default():
    code = ("from paged_jax import EngineConfig, LLMEngine\n"
            "LLMEngine(EngineConfig(model='tiny', warm_up='none', max_model_len=64, max_num_seqs=2))")
    assert _mode(code) == "False"
