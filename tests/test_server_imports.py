"""The server's HTTP process imports no jax: `paged_jax serve` runs the engine in a process of
its own (paged_jax/server/engine_core.py), and the HTTP side (the app, AsyncEngine, the chat
template and the tokenizer) stays light. Each check runs in a fresh subprocess."""

import importlib.util
import os
import subprocess
import sys

import pytest

# What the HTTP process loads: the CLI that parses `serve`, the config it builds, the server.
HTTP_MODULES = ["paged_jax.cli", "paged_jax.engine_config", "paged_jax.engine_client", "paged_jax.chat",
                "paged_jax.outputs", "paged_jax.server", "paged_jax.server.app", "paged_jax.server.engine_loop",
                "paged_jax.server.engine_core", "paged_jax.server.metrics", "paged_jax.server.protocol"]


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_http_side_modules_do_not_import_jax():
    code = (
        "import sys\n"
        f"for name in {HTTP_MODULES!r}:\n"
        "    __import__(name)\n"
        "    assert 'jax' not in sys.modules, f'importing {name} imported jax'\n"
        "from paged_jax.engine_config import EngineConfig\n"
        "from paged_jax.cli import _parser\n"
        "from paged_jax.engine_args import engine_config_kwargs\n"
        "args = _parser().parse_args(['serve', '--dtype', 'bfloat16', '--kv-cache-dtype', 'fp8'])\n"
        "EngineConfig(**engine_config_kwargs(args))  # what `serve` builds before the engine process\n"
        "assert 'jax' not in sys.modules, 'validating an EngineConfig imported jax'\n"
        "print('ok')\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.slow
def test_a_served_engine_config_leaves_this_process_without_jax():
    """make_server(EngineConfig): the engine process is spawned and ready, its tokenizer
    renders a chat prompt here, and this process still has not imported jax."""
    code = (
        "import sys\n"
        "from paged_jax.engine_config import EngineConfig\n"
        "from paged_jax.server import make_server\n"
        "config = EngineConfig('tiny', max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,\n"
        "                      warm_up='none', compile_cache_dir=None)\n"
        "server = make_server(config, port=0, chat_template=None)\n"
        "core = server.engine.core\n"
        "ids = core.tokenizer.encode('hello')\n"
        "assert ids and core.max_model_len == 128 and core.eos_token_ids, (ids, core.max_model_len)\n"
        "assert server.app is not None\n"
        "server.engine.start()\n"
        "server.engine.shutdown()\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n"
        "print('ok')\n"
    )
    out = _run(code, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


def test_the_check_itself_can_fail():
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax not installed")
    out = _run("import sys, paged_jax.server, paged_jax.engine; assert 'jax' not in sys.modules")
    assert out.returncode != 0 and "AssertionError" in out.stderr
