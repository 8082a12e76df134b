import os

# Tests run on the CPU (kernels in interpret mode); keep jax off any accelerator it finds.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines turn on jax's persistent compilation cache: keep the tests' entries out of the
# user's ~/.cache (a fresh directory per session, so compile counts are the same every run).
if "PAGED_JAX_COMPILE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PAGED_JAX_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="paged_jax_test_xla_")

from hypothesis import settings

# CI runs the stateful tests for thousands of steps; locally a shorter run keeps the loop fast.
settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
