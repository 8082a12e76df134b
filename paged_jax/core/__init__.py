"""The jax-free core: block manager, scheduler, requests, hashing, configs and step inputs.

Everything here is plain Python + numpy and imports no jax (tests/test_host_imports.py
checks it in a subprocess), so the host side can be used, tested and benchmarked alone.
Device code (runner, sampler, attention backends, models) lives outside this package.
"""
