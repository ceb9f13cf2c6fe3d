"""vpaged.serve.distributed: tensor-parallel serving on torch.distributed (gloo on CPU, NCCL on CUDA).

    llm = LLM("path/to/model", tensor_parallel_size=2, kv_budget_bytes=...)   # ranks spawned on this host
    torchrun --nproc-per-node 2 script.py                                     # or launched by torchrun

Every rank loads its shard of the model with transformers' tensor-parallel plan (tp_plan="auto") and keeps
the K/V of its own KV heads in its own KV store. Rank 0 schedules and samples; every rank applies the same
cache operations, so the stores stay in step, and runs the same forward. One concept per file:

  checks.py    configurations refused before any rank starts (heads not divisible, no plan, ...)
  launch.py    spawning the ranks (torch.multiprocessing) or joining torchrun's rendezvous
  group.py     the process groups, the control channel, timeouts and the failure report
  mirror.py    recording rank 0's store changes and replaying them on the other ranks
  runner.py    rank 0's runner: the step sent before every forward
  worker.py    the loop of every other rank
  parallel.py  TensorParallel, what the engine holds
"""

from __future__ import annotations

from .checks import check_tensor_parallel
from .group import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, collective_timeout
from .launch import torchrun_env
from .parallel import TensorParallel, sum_memory

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "TensorParallel",
    "check_tensor_parallel",
    "collective_timeout",
    "sum_memory",
    "torchrun_env",
]
