"""vpaged.integrations.vllm: the page bookkeeping of the KV backing (no vLLM needed), the switch and the
guards, and vLLM 0.32's CPU engine giving the same greedy tokens with the plugin as without it.

The vLLM tests skip where vllm is not importable (run them with the venv of scripts/test_vllm.sh). The
end-to-end run uses VLLM_ENABLE_V1_MULTIPROCESSING=0 and calls register() itself where vLLM's entry point
would (the entry point needs vpaged installed into that venv)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vpaged.errors import InvalidArgumentError
from vpaged.integrations.vllm import guard
from vpaged.integrations.vllm.backing import BlockGeometry, KVBacking, make_pool

ROOT = Path(__file__).resolve().parents[2]


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


needs_vllm = pytest.mark.skipif(
    not _has_vllm(), reason="vllm is not installed (scripts/test_vllm.sh makes a venv with it)"
)


def _reference_pages(geoms, blocks, page):
    """Pages the held blocks touch, byte by byte from the KVCacheTensor formula."""
    pages = set()
    for g in geoms:
        for b in blocks:
            for layer in range(g.num_layers):
                start = g.offset + layer * g.layer_stride + b * g.block_stride
                pages.update(x // page for x in range(start, start + g.block_bytes, 512))
                pages.add((start + g.block_bytes - 1) // page)
    return pages


@pytest.mark.parametrize("outer", ["layer", "block"])
def test_pages_follow_held_blocks(outer):
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    layers, blocks, block_bytes = rng.randint(1, 4), rng.randint(8, 64), rng.choice([4096, 12288, 65536, 98304])
    if outer == "layer":
        geom = BlockGeometry(0, block_bytes * blocks, block_bytes, block_bytes, layers, blocks)
    else:
        geom = BlockGeometry(0, block_bytes, block_bytes * layers, block_bytes, layers, blocks)
    nbytes = layers * blocks * block_bytes
    backing = KVBacking(nbytes, [geom], make_pool(nbytes))
    page = backing.page_size
    held: dict[int, int] = {}  # block -> the byte it holds in each layer span
    t = backing.tensor
    for _ in range(60):
        if rng.random() < 0.6:
            new = rng.sample(range(blocks), rng.randint(1, 4))
            backing.map_blocks(new)
            for b in new:
                if b not in held:
                    held[b] = rng.randint(1, 100)
                    for start, end in geom.spans(b):
                        t[start:end] = held[b]
        elif held:
            gone = rng.sample(sorted(held), rng.randint(1, len(held)))
            backing.release_blocks(gone)
            for b in gone:
                del held[b]
        want = _reference_pages([geom], held, page)
        assert backing.stats().mapped_bytes == len(want) * page, seed
        for b, value in held.items():
            for start, end in geom.spans(b):
                assert torch.all(t[start:end] == value), seed
    backing.release_blocks(range(blocks))
    assert backing.stats().mapped_bytes == 0
    backing.map_all()  # pages given back and mapped again read as zeros, like vLLM's torch.zeros buffer
    assert int(t.abs().sum()) == 0


def test_bad_block_changes_nothing():
    geom = BlockGeometry(0, 4096 * 32, 4096, 4096, 2, 32)
    backing = KVBacking(2 * 4096 * 32, [geom], make_pool(2 * 4096 * 32))
    backing.map_blocks([3])
    before = backing.stats()
    with pytest.raises(InvalidArgumentError):
        backing.map_blocks([4, 32])
    assert backing.stats() == before and not backing.is_mapped(4)
    with pytest.raises(InvalidArgumentError):
        KVBacking(4096, [geom], make_pool(4096))  # the tensor reaches past the buffer


def test_switch_and_version_guard():
    assert not guard.enabled({}) and not guard.enabled({"VPAGED_VLLM": "0"}) and guard.enabled({"VPAGED_VLLM": "1"})
    assert guard.version_supported("0.32.0") and guard.version_supported("0.32.0+cpu")
    assert not guard.version_supported("0.31.2") and not guard.version_supported("0.33.0")


def test_parallel_workers_are_declined(monkeypatch, caplog):
    """TP or PP > 1: the worker holding the KV is not the process with vLLM's block pool, so the plugin
    keeps vLLM's own buffer (with the reason in one warning) rather than a buffer that only grows."""
    from types import SimpleNamespace

    from vpaged.integrations.vllm import patches

    class FullAttentionSpec:  # the plain spec's name is what the guard matches
        page_size_bytes = 4096

    tensor = SimpleNamespace(size=1 << 20, layers=["a"], offset=0, layer_stride=1 << 19, block_stride=4096)
    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["a"])],
        kv_cache_tensors=[tensor],
    )
    calls = []
    allocate = patches.make_allocate_kv_cache(lambda *a: calls.append(a) or "vllm's own")
    monkeypatch.setattr(guard, "_warned", set())
    for tp, pp in [(2, 1), (1, 2), (4, 2)]:
        assert guard.parallel_refusal(tp, pp) is not None
        monkeypatch.setattr(patches, "_parallel_sizes", lambda tp=tp, pp=pp: (tp, pp))
        with caplog.at_level("WARNING", logger="vpaged.integrations.vllm"):
            assert allocate(config, torch.device("cpu"), None) == "vllm's own"
    assert len(calls) == 3 and patches.STATE.backing is None
    assert any("never give a page back" in r.getMessage() for r in caplog.records)
    assert guard.parallel_refusal(1, 1) is None


def test_a_worker_apart_from_its_scheduler_is_declined(monkeypatch, caplog):
    """vLLM's multiprocess executor (the CPU build's whenever VLLM_ENABLE_V1_MULTIPROCESSING=1) runs the worker
    in a process of its own: the block pool's frees never reach the backing, so vLLM keeps its own buffer."""
    from types import SimpleNamespace

    from vpaged.integrations.vllm import patches

    class FullAttentionSpec:
        page_size_bytes = 4096

    tensor = SimpleNamespace(size=1 << 20, layers=["a"], offset=0, layer_stride=1 << 19, block_stride=4096)
    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["a"])],
        kv_cache_tensors=[tensor],
    )
    allocate = patches.make_allocate_kv_cache(lambda *a: "vllm's own")
    monkeypatch.setattr(guard, "_warned", set())
    monkeypatch.setattr(patches, "_parallel_sizes", lambda: (1, 1))
    for backend in ("mp", "ray"):
        monkeypatch.setattr(patches, "_executor_backend", lambda b=backend: b)
        with caplog.at_level("WARNING", logger="vpaged.integrations.vllm"):
            assert allocate(config, torch.device("cpu"), None) == "vllm's own"
    assert patches.STATE.backing is None
    assert any("VLLM_ENABLE_V1_MULTIPROCESSING=0" in r.getMessage() for r in caplog.records)
    assert guard.executor_refusal("uni") is None and guard.executor_refusal(None) is None


def _cpu_backing(blocks=8, block_bytes=4096) -> KVBacking:
    geom = BlockGeometry(0, block_bytes, block_bytes, block_bytes, 1, blocks)
    return KVBacking(blocks * block_bytes, [geom], make_pool(blocks * block_bytes))


def _scheduler_output(new_blocks):
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(block_ids=[list(new_blocks)])],
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=[]),
        new_block_ids_to_zero=None,
    )


def test_v2_dummy_runs_pass_straight_through(monkeypatch):
    """The V2 runner runs profiling, warm-up and graph-capture batches through execute_model(dummy_run=True),
    which may be inside a capture: they map and release nothing (they address only block 0 and padding);
    a real step maps its blocks, with dummy_run given by keyword or by position."""
    from vpaged.integrations.vllm import patches

    backing = _cpu_backing()
    backing.map_blocks([0])
    monkeypatch.setattr(patches.STATE, "backing", backing)
    monkeypatch.setattr(patches.STATE, "map_mode", "demand")
    drained = []
    monkeypatch.setattr(patches.STATE, "drain", lambda: drained.append(1) or 0)
    ran = []

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False, is_profile=False):
        ran.append(dummy_run)
        return "output"

    step = patches.make_execute_model(execute_model)
    assert step(None, _scheduler_output([3]), dummy_run=True) == "output"
    assert step(None, _scheduler_output([4]), None, True) == "output"
    assert ran == [True, True] and not drained and backing.stats().mapped_blocks == 1
    assert step(None, _scheduler_output([5]), None, False) == "output"
    assert drained == [1] and backing.is_mapped(5) and not backing.is_mapped(3) and not backing.is_mapped(4)
    v1_step = patches.make_execute_model(lambda self, scheduler_output, intermediate_tensors=None: "v1")
    assert v1_step(None, _scheduler_output([6])) == "v1" and backing.is_mapped(6)  # V1 has no dummy_run


def test_profiling_kv_cache_stays_vllms_own(monkeypatch):
    """initialize_kv_cache(is_profiling=True) (the throwaway KV cache both runners make to measure CUDA
    graphs' memory) allocates through vLLM's own allocate_kv_cache; the real one goes on a vpaged range."""
    from types import SimpleNamespace

    from vpaged.integrations.vllm import patches

    class FullAttentionSpec:  # the plain spec's name is what the guard matches
        page_size_bytes = 4096

    tensor = SimpleNamespace(size=1 << 16, layers=["a"], offset=0, layer_stride=1 << 16, block_stride=4096)
    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["a"])],
        kv_cache_tensors=[tensor],
    )
    own = []
    allocate = patches.make_allocate_kv_cache(lambda *a: own.append(a) or "vllm's own")
    onto_vpaged = []
    monkeypatch.setattr(patches, "_allocate_on_vpaged", lambda *a: onto_vpaged.append(a) or "vpaged")
    monkeypatch.setattr(patches, "_parallel_sizes", lambda: (1, 1))

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None):
        return allocate(kv_cache_config, torch.device("cpu"), None)

    init = patches.make_initialize_kv_cache(initialize_kv_cache)
    assert init(None, config, is_profiling=True) == "vllm's own"
    assert init(None, config, True) == "vllm's own"
    assert len(own) == 2 and not onto_vpaged and patches.STATE.profiling == 0
    assert init(None, config) == "vpaged" and init(None, config, False, None) == "vpaged"
    assert len(own) == 2 and len(onto_vpaged) == 2

    def failing(self, kv_cache_config, is_profiling=False):
        raise RuntimeError("vLLM failed")

    with pytest.raises(RuntimeError, match="vLLM failed"):
        patches.make_initialize_kv_cache(failing)(None, config, is_profiling=True)
    assert patches.STATE.profiling == 0


def test_graph_capture_is_announced_and_counted(monkeypatch):
    """vLLM's graph_capture context, wrapped: inside it the plugin's idle thread sees a capture (and
    vpaged.memory's flag is up, where this vpaged has it); after it, also after an error, neither."""
    import contextlib

    from vpaged.integrations.vllm import patches, runners

    seen = []

    @contextlib.contextmanager
    def vllm_graph_capture(device):
        seen.append(("enter", device, patches.STATE.captures))
        yield "context"
        seen.append(("exit", patches.STATE.captures))

    wrapped = runners.make_graph_capture(vllm_graph_capture)
    assert not patches.STATE.capturing()
    with wrapped(device="cuda:0") as context:
        assert context == "context" and patches.STATE.captures == 1 and patches.STATE.capturing()
        if runners.vpaged_capture_available():
            from vpaged.memory import capture_active

            assert capture_active()
    assert seen == [("enter", "cuda:0", 1), ("exit", 1)]
    assert patches.STATE.captures == 0 and not patches.STATE.capturing()
    with pytest.raises(ValueError), wrapped(device="cuda:0"):
        raise ValueError("the capture failed")
    assert patches.STATE.captures == 0 and not patches.STATE.capturing()


def test_a_runner_whose_names_moved_is_declined_with_one_warning(monkeypatch, caplog):
    """A runner module without the names the hooks go on: no hook goes on it, one warning says which runner
    and which names (vLLM keeps its own buffer under it); a runner vLLM could not import is skipped quietly."""
    import types

    from vpaged.integrations.vllm import runners

    moved = types.ModuleType("fake_vllm_runner_moved")

    class Runner:
        def execute_model(self, scheduler_output):
            return "vllm"

    moved.Runner = Runner  # no allocate_kv_cache, no initialize_kv_cache
    monkeypatch.setitem(sys.modules, moved.__name__, moved)
    monkeypatch.setattr(
        runners,
        "RUNNERS",
        (
            runners.RunnerNames("VX", moved.__name__, "Runner", moved.__name__),
            runners.RunnerNames("VY", "fake_vllm_runner_absent", "Runner", "fake_vllm_runner_absent"),
        ),
    )
    monkeypatch.setattr(runners, "HOOKED", {})
    monkeypatch.setattr(runners, "DECLINED", {})
    monkeypatch.setattr(guard, "_warned", set())
    with caplog.at_level("WARNING", logger="vpaged.integrations.vllm"):
        assert runners.install_runner_hooks() == {}
        assert runners.install_runner_hooks() == {}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "VX model runner cannot be hooked" in warnings[0], warnings
    assert "fake_vllm_runner_moved.allocate_kv_cache" in warnings[0] and "initialize_kv_cache" in warnings[0]
    assert Runner.execute_model(None, None) == "vllm" and not hasattr(Runner.execute_model, "_vpaged_original")
    assert set(runners.DECLINED) == {"VX", "VY"} and not runners.hooked_runner(Runner)


def test_exit_during_a_release_round_ends_the_process_cleanly():
    # The process ends while the idle thread is inside a release round whose torch calls let the GIL go: the
    # round finishes and the thread is joined before the interpreter finalizes (else the daemon thread is
    # ended inside C++ frames and the process aborts with "terminate called without an active exception").
    proc = subprocess.run(
        [sys.executable, __file__, "exit-in-release"],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rounds = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rounds["started"] >= 1 and rounds["finished"] == rounds["started"], rounds


@needs_vllm
def test_off_by_default_changes_nothing(monkeypatch):
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu import attn_utils

    import vpaged.integrations.vllm as plugin

    monkeypatch.delenv("VPAGED_VLLM", raising=False)
    before = gpu_model_runner.allocate_kv_cache, attn_utils.allocate_kv_cache
    assert plugin.register() is plugin.installed()
    if not plugin.installed():
        assert (gpu_model_runner.allocate_kv_cache, attn_utils.allocate_kv_cache) == before
        assert not any(hasattr(f, "_vpaged_original") for f in before)


@needs_vllm
def test_unsupported_version_declines_with_a_warning(monkeypatch, caplog):
    import vllm
    from vllm.v1.worker import gpu_model_runner

    import vpaged.integrations.vllm as plugin

    if plugin.installed():
        pytest.skip("the hooks are already in this process")
    monkeypatch.setenv("VPAGED_VLLM", "1")
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    monkeypatch.setattr(guard, "_warned", set())
    before = gpu_model_runner.allocate_kv_cache
    with caplog.at_level("WARNING", logger="vpaged.integrations.vllm"):
        assert plugin.register() is False
    assert gpu_model_runner.allocate_kv_cache is before
    assert any("0.31.9 is not a supported version" in r.getMessage() for r in caplog.records)


@needs_vllm
def test_layouts_it_cannot_map_are_refused():
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)
    tensor = KVCacheTensor(size=1 << 20, layers=["a"], layer_stride=1 << 19, block_stride=full.page_size_bytes)

    def config(*specs):
        groups = [SimpleNamespace(kv_cache_spec=s, layer_names=["a"]) for s in specs]
        return SimpleNamespace(kv_cache_groups=groups, kv_cache_tensors=[tensor])

    assert guard.layout_refusal(config(full)) is None
    assert "SlidingWindowSpec" in guard.layout_refusal(config(window))
    assert "hybrid" in guard.layout_refusal(config(full, window))


def _run_entry(*args, env=None, timeout=600) -> dict:
    """This file's entry point in a fresh process (its hooks stay out of this pytest process); its last line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_vllm
def test_the_runner_vllm_picks_is_hooked():
    """vLLM 0.32 builds its V2 model runner wherever Triton runs (every CUDA install) and V1 on the CPU
    build: for each case of vLLM's own choice (VllmConfig.use_v2_model_runner, read with Triton there or
    not, VLLM_USE_V2_MODEL_RUNNER unset / 0 / 1, features V2 lacks or none), the class vLLM's GPU worker
    builds (Worker._make_model_runner, the constructor skipped) carries the step hook, and the
    allocate_kv_cache name its KV cache goes through puts the buffer on a vpaged range. The CPU runners
    (V1 and V2) too; vLLM's graph_capture is wrapped under every name it is called by."""
    out = _run_entry("runners", env={"VPAGED_VLLM": "1"})
    cases = out["cases"]
    assert len(cases) == 12
    for case in cases:
        want_v2 = case["env"] == "1" or (case["env"] is None and case["triton"] and not case["unsupported"])
        assert case["use_v2"] == want_v2, case
        assert case["runner"] == ("vllm.v1.worker.gpu.model_runner" if want_v2 else "vllm.v1.worker.gpu_model_runner")
        assert case["step_hooked"] and case["allocates_on_vpaged"], case
    assert out["cpu_runners_hooked"] == {"V1": True, "V2": True}
    assert out["graph_capture_wrapped"] == {
        "vllm.distributed.parallel_state": True,
        "vllm.v1.worker.gpu_model_runner": True,
        "vllm.v1.worker.gpu.cudagraph_utils": True,
    }
    assert out["hooked_runner"] is True and out["declined"] == {}


def _runner_cases() -> dict:
    """The entry point of test_the_runner_vllm_picks_is_hooked (a fresh process, VPAGED_VLLM=1)."""
    from types import SimpleNamespace
    from unittest import mock

    import vllm.distributed.parallel_state as parallel_state
    from vllm.config import VllmConfig
    from vllm.config import vllm as config_module
    from vllm.v1 import kv_cache_interface as kv
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import cpu_model_runner, gpu_worker
    from vllm.v1.worker import gpu_model_runner as v1
    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker.cpu import model_runner as cpu_v2
    from vllm.v1.worker.gpu import attn_utils, cudagraph_utils
    from vllm.v1.worker.gpu import model_runner as v2

    import vpaged.integrations.vllm as plugin

    vllm_allocate = worker_utils.allocate_kv_cache
    vllm_steps = {
        v1.GPUModelRunner: v1.GPUModelRunner.execute_model,
        v2.GPUModelRunner: v2.GPUModelRunner.execute_model,
    }
    capture_modules = (parallel_state, v1, cudagraph_utils)
    vllm_captures = {m.__name__: m.graph_capture for m in capture_modules}
    assert plugin.register() and plugin.installed()
    allocate_names = {v1.GPUModelRunner: v1, v2.GPUModelRunner: attn_utils}  # the name each runner calls
    spec = kv.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    blocks = 8

    def allocates_on_vpaged(module) -> bool:
        """The runner's allocate_kv_cache name, called as its initialize_kv_cache calls it: the views lie in
        the plugin's range (a fresh one each call)."""
        tensor = kv.KVCacheTensor(
            size=2 * blocks * spec.page_size_bytes,
            layers=["l0", "l1"],
            layer_stride=blocks * spec.page_size_bytes,
            block_stride=spec.page_size_bytes,
        )
        config = kv.KVCacheConfig(
            num_blocks=blocks, kv_cache_tensors=[tensor], kv_cache_groups=[kv.KVCacheGroupSpec(["l0", "l1"], spec)]
        )
        before = plugin.STATE.backing
        views = module.allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, None)
        backing = plugin.STATE.backing
        if module.allocate_kv_cache is vllm_allocate or backing is None or backing is before:
            return False
        start, end = backing.address, backing.address + backing.nbytes
        return all(start <= v.data_ptr() < end for v in views.values())

    cases = []
    for triton in (True, False):
        for env in (None, "0", "1"):
            for unsupported in ([], ["a feature V2 lacks"]):
                config = SimpleNamespace(
                    attention_config=SimpleNamespace(hisparse_config=None),
                    _get_v2_model_runner_unsupported_features=lambda u=unsupported: u,
                    is_mm_encoder_only=False,
                )
                with mock.patch.object(config_module, "HAS_TRITON", triton), mock.patch.dict(os.environ):
                    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
                    if env is not None:
                        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = env
                    use_v2 = VllmConfig.use_v2_model_runner.fget(config)
                worker = SimpleNamespace(use_v2_model_runner=use_v2, vllm_config=config, device=torch.device("cpu"))
                with (
                    mock.patch.object(v1.GPUModelRunner, "__init__", lambda self, *a: None),
                    mock.patch.object(v2.GPUModelRunner, "__init__", lambda self, *a: None),
                ):
                    runner = gpu_worker.Worker._make_model_runner(worker)
                cls = type(runner)
                base = next(b for b in allocate_names if issubclass(cls, b))
                cases.append(
                    {
                        "triton": triton,
                        "env": env,
                        "unsupported": bool(unsupported),
                        "use_v2": use_v2,
                        "runner": cls.__module__,
                        "step_hooked": cls.execute_model is not vllm_steps[base],
                        "allocates_on_vpaged": allocates_on_vpaged(allocate_names[base]),
                    }
                )
    wrapped = {m.__name__: m.graph_capture is not vllm_captures[m.__name__] for m in capture_modules}
    return {
        "cases": cases,
        "cpu_runners_hooked": {
            "V1": plugin.hooked_runner(cpu_model_runner.CPUModelRunner),
            "V2": plugin.hooked_runner(cpu_v2.CPUModelRunner),
        },
        "graph_capture_wrapped": wrapped,
        "hooked_runner": plugin.hooked_runner(v1.GPUModelRunner) and plugin.hooked_runner(v2.GPUModelRunner),
        "declined": dict(plugin.runners.DECLINED),
    }


def _run_engine(model_dir: Path, workload: str, plugin: bool, blocks: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env["VPAGED_VLLM"] = "1" if plugin else "0"
    cmd = [sys.executable, __file__, "engine", str(model_dir), workload, str(blocks)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_llama")
    proc = subprocess.run([sys.executable, __file__, "model", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@needs_vllm
@pytest.mark.parametrize("workload", ["random", "prefix"])
def test_greedy_tokens_identical_with_the_plugin(tiny_llama, workload):
    # Few blocks (640 of 16 tokens for 64 requests of up to 640 tokens) so vLLM preempts and reuses blocks:
    # pages are given back and mapped again while requests run.
    off = _run_engine(tiny_llama, workload, plugin=False, blocks=640)
    on = _run_engine(tiny_llama, workload, plugin=True, blocks=640)
    assert off["plugin"] is None and on["plugin"] is not None
    assert on["tokens"] == off["tokens"]
    assert on["plugin"]["mapped_bytes"] < on["plugin"]["reserved_bytes"]


# ---- subprocess entry points (the engine must start in a fresh process) ----


def _make_model(out: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(3)} | {f"t{i}": i + 3 for i in range(509)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token="<1>", eos_token="<2>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)


def workload_prompts(kind: str, n: int = 64, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "random":
        return [[rng.randrange(3, 512) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    prefixes = [[rng.randrange(3, 512) for _ in range(rng.choice([128, 256]))] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(3, 512) for _ in range(rng.randint(8, 200))] for _ in range(n)]


def _engine(model: str, workload: str, blocks: int) -> None:
    import vpaged.integrations.vllm as plugin

    plugin.register()  # where vLLM's entry point would call it
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        num_gpu_blocks_override=blocks,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in workload_prompts(workload)], params)
    s = plugin.stats()
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "plugin": s and s.__dict__}))


def _exit_in_release() -> None:
    import atexit
    import threading

    from vpaged.integrations.vllm import patches

    state, entered = patches.PluginState(), threading.Event()
    rounds = {"started": 0, "finished": 0}
    x = torch.randn(192, 192)

    def drain():  # a release round long enough for the main thread to end inside it
        rounds["started"] += 1
        entered.set()
        for _ in range(200):
            torch.mm(x, x).clamp_(-1, 1)
        rounds["finished"] += 1
        return 0

    state.drain = drain
    # atexit runs its hooks last registered first: this one reports after the idle thread's stop.
    atexit.register(lambda: print(json.dumps(rounds), flush=True))
    state.start_idle_thread()
    assert entered.wait(30)  # then the interpreter ends with the round under way


if __name__ == "__main__":
    if sys.argv[1] == "exit-in-release":
        _exit_in_release()
    elif sys.argv[1] == "model":
        _make_model(sys.argv[2])
    elif sys.argv[1] == "runners":
        print(json.dumps(_runner_cases()))
    else:
        _engine(sys.argv[2], sys.argv[3], int(sys.argv[4]))
