"""Starting the ranks of a tensor-parallel engine: spawned by rank 0, or launched by torchrun.

  spawned   (one host) the caller of LLMEngine / LLM is rank 0: it hosts the rendezvous store (a TCPStore on
            127.0.0.1, a free port) and starts ranks 1..N-1 with torch.multiprocessing ("spawn"), each
            running worker.spawned. The script that creates the engine must guard its top level with
            `if __name__ == "__main__":`, as every spawn start method needs.
  torchrun  (one or more hosts) every process runs the same script; torchrun sets RANK, WORLD_SIZE,
            LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and the store comes from its rendezvous (env://). The
            engine's constructor returns on every rank; the ranks > 0 then call run_worker(engine), which
            serves rank 0 and returns when rank 0's engine closes.

On CUDA, each rank makes its device current (torch.cuda.set_device(LOCAL_RANK)) before it joins the process
group, and binds it there (init_process_group(..., device_id=...)): NCCL then uses that device for the
group's communicators instead of guessing one from the rank (rank % GPUs, wrong across hosts).

A "random:<name>" model exists only as a config: it is saved once to a temporary directory (each torchrun
rank saves its own copy from the same seed) so that every rank loads it the way it loads a checkpoint, with
transformers' tensor-parallel plan; the directory is removed when the engine closes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...errors import InvalidArgumentError, TensorParallelError
from ..models import load_model
from .checks import check_tensor_parallel
from .group import Group, collective_timeout
from .worker import spawned

JOINED_KEY = "vpaged/joined/{}"
# Seconds a spawned rank may take to import and reach the process group (interpreter start, torch and
# transformers imports: ~6 s on a 2-core box), whatever the collectives' timeout.
START_TIMEOUT_S = 300.0


@dataclass
class Launch:
    """This process's rank, its group, where to load the model from and the config it runs with."""

    group: Group
    model_path: str
    config: object  # EngineConfig, with this rank's device
    temp_dir: str | None


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun (or a launcher like it) started this process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def materialize(spec, dtype: torch.dtype) -> tuple[str, str | None]:
    """(a directory to load `spec` from, the temporary directory to remove later or None)."""
    if isinstance(spec, str) and spec.startswith("random:"):
        model, _ = load_model(spec, dtype)
        temp = tempfile.mkdtemp(prefix="vpaged-tp-")
        model.save_pretrained(temp)
        del model
        return temp, temp
    return os.fspath(spec), None


def start(spec, config, engine_class) -> Launch:
    """Check, then start or join the ranks of a tensor-parallel engine (see the module docstring)."""
    size = config.parallel.tensor_parallel_size
    check_tensor_parallel(spec, size, config.model.device)
    timeout = collective_timeout()
    backend = "nccl" if config.model.device.type == "cuda" else "gloo"
    env = torchrun_env()
    if env is not None and env[1] != size:
        raise InvalidArgumentError(f"tensor_parallel_size={size}, but this launch has WORLD_SIZE={env[1]} processes")
    if env is not None and os.environ.get("MASTER_PORT") == "0":  # torchrun --master-port 0 hands the ranks 0
        raise InvalidArgumentError("MASTER_PORT=0: give torchrun a real --master-port (or use --rdzv-endpoint)")
    if dist.is_initialized():
        raise InvalidArgumentError("torch.distributed is already initialised in this process: one engine per launch")
    dtype = config.model.dtype or torch.float32
    rank, _, local_rank = env if env is not None else (0, size, 0)
    device = None
    if config.model.device.type == "cuda":  # current before the process group exists (see the module docstring)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        config = replace(config, device=device)
    path, temp = materialize(spec, dtype)
    try:
        if env is None:
            group = _spawn(path, config, size, backend, timeout, engine_class, device)
        else:
            store, _, _ = next(dist.rendezvous("env://", rank, size, timeout=timedelta(seconds=timeout)))
            store.set(JOINED_KEY.format(rank), "1")
            group = Group(rank, size, store, backend, timeout, device=device)
    except BaseException:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    return Launch(group, path, config, temp)


def _spawn(path: str, config, size: int, backend: str, timeout: float, engine_class, device) -> Group:
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    processes = {}
    for rank in range(1, size):
        rank_config = (
            replace(config, device=torch.device("cuda", rank)) if config.model.device.type == "cuda" else config
        )
        p = ctx.Process(
            target=spawned,
            args=(rank, size, store.port, path, rank_config, timeout, torch.get_num_threads(), engine_class),
            name=f"vpaged-tp-rank{rank}",
            daemon=True,
        )
        p.start()
        processes[rank] = p
    try:
        _wait_joined(store, processes, timeout)
        return Group(0, size, store, backend, timeout, processes, device=device)
    except BaseException:
        for p in processes.values():
            if p.is_alive():
                p.kill()
            p.join(5.0)
        raise


def _wait_joined(store, processes: dict, timeout: float) -> None:
    """Wait until every spawned rank is about to join the process group; a rank that dies first (a failed
    import, a model it cannot load) is reported with its cause instead of a wait for the timeout."""
    limit = max(timeout, START_TIMEOUT_S)
    deadline = time.monotonic() + limit
    waiting = set(processes)
    while waiting:
        for rank in sorted(waiting):
            if store.check([JOINED_KEY.format(rank)]):
                waiting.discard(rank)
            elif processes[rank].exitcode is not None:
                key = f"vpaged/error/{rank}"
                time.sleep(0.2)
                cause = store.get(key).decode() if store.check([key]) else f"exit code {processes[rank].exitcode}"
                raise TensorParallelError(f"rank {rank} failed while starting: {cause}")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"ranks {sorted(waiting)} did not start within {limit:.0f} s")
        time.sleep(0.05)
