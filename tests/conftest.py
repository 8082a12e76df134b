import os

# Tests run on the CPU (kernels in interpret mode); keep jax off any accelerator it finds.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings

# CI runs the stateful tests for thousands of steps; locally a shorter run keeps the loop fast.
settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
