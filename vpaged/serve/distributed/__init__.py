"""vpaged.serve.distributed: tensor-parallel serving on torch.distributed (gloo on CPU, NCCL on CUDA).

    llm = LLM("path/to/model", tensor_parallel_size=2, kv_budget_bytes=...)   # ranks spawned on this host
    torchrun --nproc-per-node 2 script.py                                     # or launched by torchrun

Every rank loads its shard of the model with transformers' tensor-parallel plan (tp_plan="auto") and keeps
the K/V of its own KV heads in its own KV store. Rank 0 schedules and samples; every rank applies the same
cache operations, so the stores stay in step, and runs the same forward. One concept per file:

  checks.py    configurations refused before any rank starts (heads not divisible, no plan, ...)
  launch.py    spawning the ranks (torch.multiprocessing) or joining torchrun's rendezvous
  group.py     the process groups, the control channel, timeouts and the failure report
  messages.py  the control messages rank 0 broadcasts (Step, MemoryRequest, Ping, Stop), frozen records
  mirror.py    rank 0's store changes recorded as operation records and replayed on the other ranks
  runner.py    rank 0's runner: the Step sent before every forward
  worker.py    run_worker(engine), the loop of every other rank
  parallel.py  TensorParallel, what the engine holds

The engine's constructor returns on every rank; under torchrun the ranks > 0 then serve rank 0:

    engine = LLMEngine("path/to/model", tensor_parallel_size=2, kv_budget_bytes=...)
    if engine.rank != 0:
        run_worker(engine)        # returns when rank 0's engine closes
"""

from __future__ import annotations

from .checks import check_tensor_parallel
from .group import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, collective_timeout
from .launch import torchrun_env
from .parallel import TensorParallel, sum_memory
from .worker import run_worker

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "TensorParallel",
    "check_tensor_parallel",
    "collective_timeout",
    "run_worker",
    "sum_memory",
    "torchrun_env",
]
