"""vpaged under vLLM: vLLM's KV cache on a vpaged virtual range, pages mapped as its block pool hands blocks out.

vLLM loads `register` through its `vllm.general_plugins` entry point in every process it starts. It does
nothing unless VPAGED_VLLM=1 (installing vpaged never changes vLLM) and the running vLLM is one of
guard.SUPPORTED_VLLM_VERSIONS; otherwise, and for KV layouts it cannot map block by block, it leaves vLLM
untouched with one warning. Both of vLLM's model runners get the hooks (runners.py: V2 is the one vLLM
uses wherever Triton runs, V1 the CPU build's). `stats()` reports vpaged's bytes for the vLLM KV buffer of
this process.
"""

from __future__ import annotations

import os

from .backing import BackingStats, BlockGeometry, KVBacking
from .guard import SUPPORTED_VLLM_VERSIONS, SWITCH_ENV, enabled, version_supported, warn_once
from .patches import STATE
from .runners import hooked_runner

__all__ = [
    "register",
    "stats",
    "installed",
    "hooked_runner",
    "BackingStats",
    "BlockGeometry",
    "KVBacking",
    "SUPPORTED_VLLM_VERSIONS",
    "SWITCH_ENV",
]

_installed = False


def installed() -> bool:
    """Whether this process's vLLM runs with the plugin's hooks."""
    return _installed


def register() -> bool:
    """The entry point: install the hooks when switched on and supported; returns whether they are in."""
    global _installed
    if _installed or not enabled(os.environ):
        return _installed
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version_supported(version):
        warn_once(
            "version",
            f"vLLM {version} is not a supported version ({', '.join(SUPPORTED_VLLM_VERSIONS)}); "
            f"{SWITCH_ENV}=1 is ignored and vLLM keeps its own KV buffer",
        )
        return False
    from vllm.v1.core import block_pool
    from vllm.v1.core.sched import scheduler

    from . import patches, runners

    # Both model runners: vLLM picks V2 wherever Triton runs (every CUDA install), V1 on the CPU build.
    if not runners.install_runner_hooks():
        warn_once(
            "runners",
            "no model runner of this vLLM could be hooked ("
            + "; ".join(f"{k}: {v}" for k, v in runners.DECLINED.items())
            + f"); {SWITCH_ENV}=1 is ignored and vLLM keeps its own KV buffer",
        )
        return False
    runners.install_capture_hooks()
    for name, fn in patches.make_block_pool_hooks(block_pool.BlockPool).items():
        setattr(block_pool.BlockPool, name, fn)
    scheduler_hooks, pool_hooks = patches.make_scheduler_hooks(scheduler.Scheduler, block_pool.BlockPool)
    for cls, hooks in ((scheduler.Scheduler, scheduler_hooks), (block_pool.BlockPool, pool_hooks)):
        for name, fn in hooks.items():
            setattr(cls, name, fn)
    _installed = True
    return True


def stats() -> BackingStats | None:
    """vpaged's bytes (reserved, mapped, live, dormant) for the vLLM KV buffer of this process, or None."""
    return STATE.backing.stats() if STATE.backing is not None else None
