import os

# Tests run on the CPU (kernels in interpret mode); keep jax off any accelerator it finds.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines turn on jax's persistent compilation cache: keep the tests' entries out of the
# user's ~/.cache (a fresh directory per session, so compile counts are the same every run).
if "PAGED_JAX_COMPILE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PAGED_JAX_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="paged_jax_test_xla_")

import jax  # noqa: E402
from hypothesis import settings

# CI runs the stateful tests for thousands of steps; locally a shorter run keeps the loop fast.
settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


import gc  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_engines_after_each_module():
    """Engines cached by a test module (functools.cache helpers, tests/engine_reference.py's)
    are released when it ends, and jax's caches with them. Every compiled XLA:CPU program
    holds ~150 memory maps and a process has 65530 (vm.max_map_count): kept for the whole
    suite they ran out, and XLA crashed mid-suite in whichever test compiled next."""
    yield
    tests_dir = __file__.rsplit("/", 1)[0]
    for module in list(sys.modules.values()):
        if not (getattr(module, "__file__", None) or "").startswith(tests_dir):
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == module.__name__:
                value.cache_clear()
    gc.collect()
    jax.clear_caches()
