"""Host modules import no jax: the block manager (and scheduler, batch building) stay light."""

import importlib.util
import subprocess
import sys

import pytest

HOST_MODULES = [
    "paged_jax.hashing",
    "paged_jax.kv_cache_block",
    "paged_jax.block_pool",
    "paged_jax.kv_cache_manager",
    "paged_jax.request",
    "paged_jax.batch",
    "paged_jax.scheduler",
]


def test_host_modules_do_not_import_jax():
    present = [m for m in HOST_MODULES if importlib.util.find_spec(m) is not None]
    assert "paged_jax.kv_cache_manager" in present
    code = (
        "import sys\n"
        f"for name in {present!r}:\n"
        "    __import__(name)\n"
        "    assert 'jax' not in sys.modules, f'importing {name} imported jax'\n"
        "print('ok', len(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_the_check_itself_can_fail():
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax not installed")
    code = "import sys, paged_jax.kv_cache_manager, jax; assert 'jax' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 0
