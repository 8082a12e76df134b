"""Host modules import no jax: every module of the paged_jax.core package stays light."""

import importlib.util
import pkgutil
import subprocess
import sys

import pytest

import paged_jax.core

# Every module of the package, so a new core module is checked without editing this list.
HOST_MODULES = ["paged_jax.core"] + [f"paged_jax.core.{m.name}" for m in pkgutil.iter_modules(paged_jax.core.__path__)]


def test_host_modules_do_not_import_jax():
    present = [m for m in HOST_MODULES if importlib.util.find_spec(m) is not None]
    assert {"paged_jax.core.kv_cache_manager", "paged_jax.core.scheduler", "paged_jax.core.batch",
            "paged_jax.core.config", "paged_jax.core.step_inputs", "paged_jax.core.tokenizer"} <= set(present)
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
    code = "import sys, paged_jax.core.kv_cache_manager, jax; assert 'jax' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 0
