"""vLLM 0.32's two model runners, and the hooks the plugin puts on each.

vLLM builds one of two GPU model runners (`vllm/v1/worker/gpu_worker.py` `_make_model_runner`, and the CPU
worker the same way): the V2 runner (`vllm.v1.worker.gpu.model_runner.GPUModelRunner`) whenever
`VllmConfig.use_v2_model_runner` holds, which it does by default as soon as Triton is installed with a
driver for the device (every CUDA install), else the V1 runner (`vllm.v1.worker.gpu_model_runner`). The
CPU build's Triton has no CPU backend, so the CPU runs V1 unless VLLM_USE_V2_MODEL_RUNNER=1. Each runner
allocates its KV cache through `vllm.v1.worker.utils.allocate_kv_cache`, imported by name into its own
module (V1: gpu_model_runner, V2: gpu/attn_utils), so the hook goes on both names; the runners' own
subclasses (the CPU runners) inherit the other hooks. A runner whose module cannot be imported is one vLLM
cannot build either; one whose names moved is declined with one warning, and vLLM keeps its own KV buffer
when it builds that runner.

CUDA graph captures: vLLM captures inside `vllm.distributed.parallel_state.graph_capture` (imported by name
into gpu_model_runner and gpu/cudagraph_utils). The hook wraps it in vpaged.memory.graph_capture() (where
this vpaged has it: vpaged then defers releases and limit changes until the capture ends) and counts it in
STATE.captures (the plugin's idle thread releases nothing meanwhile).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass

from . import patches
from .guard import warn_once


@dataclass(frozen=True)
class RunnerNames:
    """Where one of vLLM's model runners lives: its class, and the module whose `allocate_kv_cache` name its
    initialize_kv_cache calls."""

    label: str
    module: str
    cls: str
    allocate_module: str


RUNNERS = (
    RunnerNames("V1", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "vllm.v1.worker.gpu_model_runner"),
    RunnerNames("V2", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "vllm.v1.worker.gpu.attn_utils"),
)
# The modules that call vLLM's graph_capture context by the name they imported (parallel_state: its own,
# which vLLM's multimodal encoder runner imports when it captures).
GRAPH_CAPTURE_MODULES = (
    "vllm.distributed.parallel_state",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.cudagraph_utils",
)
HOOK_NAMES = ("execute_model", "initialize_kv_cache")

HOOKED: dict[str, type] = {}  # label -> the runner class that carries the hooks in this process
DECLINED: dict[str, str] = {}  # label -> why that runner carries none


def hooked_runner(cls: type) -> bool:
    """Whether the runner class `cls` (one vLLM built, or would build) runs with the plugin's hooks: it is,
    or derives from, a hooked runner, and the allocate_kv_cache name that runner calls is the plugin's."""
    for label, base in HOOKED.items():
        if isinstance(cls, type) and issubclass(cls, base):
            names = next(r for r in RUNNERS if r.label == label)
            allocate = getattr(importlib.import_module(names.allocate_module), "allocate_kv_cache", None)
            # execute_model as cls has it (an override would skip the step hook); initialize_kv_cache as the
            # base has it (the CPU runner's override calls it through super()).
            return all(hasattr(f, "_vpaged_original") for f in (allocate, cls.execute_model, base.initialize_kv_cache))
    return False


def _hook_method(cls: type, name: str, make) -> None:
    original = getattr(cls, name)
    wrapped = make(original)
    wrapped._vpaged_original = original
    setattr(cls, name, wrapped)


def install_runner_hooks() -> dict[str, type]:
    """Put the hooks on every model runner this vLLM has; returns the hooked ones (label -> class)."""
    for names in RUNNERS:
        if names.label in HOOKED:
            continue
        try:
            runner_module = importlib.import_module(names.module)
            allocate_module = importlib.import_module(names.allocate_module)
        except ImportError as e:  # vLLM cannot build this runner either (it imports the same module)
            DECLINED[names.label] = f"its module does not import here ({e})"
            continue
        cls = getattr(runner_module, names.cls, None)
        missing = [f"{names.allocate_module}.allocate_kv_cache"] * (not hasattr(allocate_module, "allocate_kv_cache"))
        missing += [f"{names.module}.{names.cls}.{n}" for n in HOOK_NAMES if not hasattr(cls, n)]
        if missing:
            DECLINED[names.label] = f"{', '.join(missing)} not found"
            warn_once(
                "runner:" + names.label,
                f"vLLM's {names.label} model runner cannot be hooked ({DECLINED[names.label]}): when vLLM "
                "builds it, vLLM keeps its own KV buffer",
            )
            continue
        allocate_module.allocate_kv_cache = patches.make_allocate_kv_cache(allocate_module.allocate_kv_cache)
        _hook_method(cls, "execute_model", patches.make_execute_model)
        _hook_method(cls, "initialize_kv_cache", patches.make_initialize_kv_cache)
        HOOKED[names.label] = cls
        DECLINED.pop(names.label, None)
    return dict(HOOKED)


def _vpaged_graph_capture():
    """vpaged.memory.graph_capture where this vpaged has it, else None."""
    try:
        from ...memory import graph_capture
    except ImportError:
        return None
    return graph_capture


def make_graph_capture(original):
    """vLLM's graph_capture(device) context, inside vpaged's capture context and counted in STATE."""
    vpaged_capture = _vpaged_graph_capture()

    @contextlib.contextmanager
    @functools.wraps(original)
    def graph_capture(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            if vpaged_capture is not None:
                stack.enter_context(vpaged_capture())
            patches.STATE.captures += 1
            stack.callback(_capture_done)
            yield stack.enter_context(original(*args, **kwargs))

    graph_capture._vpaged_original = original
    return graph_capture


def _capture_done() -> None:
    patches.STATE.captures -= 1


def install_capture_hooks() -> list[str]:
    """Wrap vLLM's graph_capture under every name it is called by; returns the modules hooked."""
    done, wrapped = [], {}
    for module_name in GRAPH_CAPTURE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(module, "graph_capture", None)
        if original is None or hasattr(original, "_vpaged_original"):
            continue
        if original not in wrapped:  # one wrapper per function: every name gets the same one
            wrapped[original] = make_graph_capture(original)
        module.graph_capture = wrapped[original]
        done.append(module_name)
    return done


def vpaged_capture_available() -> bool:
    """Whether vLLM's captures also run inside vpaged.memory.graph_capture() (this vpaged has it)."""
    return _vpaged_graph_capture() is not None
