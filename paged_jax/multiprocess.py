"""One engine across processes (one per host in production) on JAX's multi-controller runtime.

How the processes agree: every process runs the same engine on the same request stream.
jax is multi-controller SPMD: each process runs the same program on its own devices, and
the mesh's collectives connect them. The scheduler, the block manager and the batch
builder are deterministic functions of the requests and of the sampled tokens, and the
sampled tokens are replicated (every process reads the same ids back), so processes given
the same requests in the same order build the same StepInputs every step, without a
leader and without shipping inputs around. What would break that is kept out:
- the padded step inputs depend on the batch alone, but which compiled program runs a step
  could depend on timing (a single-process engine warming up in the background runs a step
  in a larger compiled bucket while its own compiles); with several processes a step
  always waits for its own bucket (ModelRunner.choose_shape), so warm-up may still run in
  the background;
- unseeded sampling draws from EngineConfig.seed, the same in every process;
- the runner compares a digest of each step's inputs across processes before running it
  (multihost_utils.assert_equal), so a diverged process fails loudly instead of hanging
  in, or garbling, a collective.
A server fronting several hosts must therefore feed every process the same requests (the
usual setup: process 0 takes requests and the others replay them); LLM.generate over the
same prompt list does it trivially, which is how tests/test_multiprocess.py runs it.

Running it (docs in README, "Several devices and hosts"):

    # on each host h of H, same command, its own process id
    python -m paged_jax generate --tensor-parallel-size 16 \\
        --coordinator-address host0:1234 --num-processes H --process-id h ...

The mesh spans every process's devices (jax.devices()), so tensor_parallel_size must be
the global device count.
"""

from __future__ import annotations

import jax


def initialize(coordinator_address: str, num_processes: int, process_id: int, *, local_device_ids=None,
               initialization_timeout: int = 300) -> None:
    """jax.distributed.initialize, with the CPU backend's collectives set to gloo first.

    Call it once per process, before anything else touches jax (it fixes the device list).

    Args:
      coordinator_address: "host:port" of process 0's coordinator, the same for all.
      num_processes: how many processes take part.
      process_id: this process's index, 0..num_processes-1.
      local_device_ids: this process's devices (default: all it sees).
      initialization_timeout: seconds to wait for the others to join.
    """
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    # Read by the CPU client only (GPUs use NCCL); gloo over TCP is what CPU collectives
    # across processes need, and setting it on a GPU host is harmless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout)


def check_multiprocess_config(tensor_parallel_size: int, data_parallel_size: int) -> None:
    """ValueError unless one engine spans every process's devices (what the runtime supports)."""
    if jax.process_count() == 1:
        return
    if data_parallel_size != 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} with {jax.process_count()} processes: replicas "
                         "run in one process; across processes use tensor_parallel_size")
    if tensor_parallel_size != jax.device_count():
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} with {jax.process_count()} processes must be "
                         f"the global device count {jax.device_count()} (one engine over every process's devices)")
