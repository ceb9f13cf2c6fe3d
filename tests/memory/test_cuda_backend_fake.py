"""The CUDA backend's logic without a GPU: csrc/backends/cuda_backend.cpp driven through a fake driver.

tests/fake_cuda/fake_libcuda.cpp is a libcuda.so.1 that implements the driver's VMM calls on host memory
(allocations are memfds, reservations PROT_NONE mmaps, cuMemMap a MAP_SHARED|MAP_FIXED mmap) and enforces
the driver's rules: a current context for memory calls, whole mappings for unmap and set-access,
alignment, no access before cuMemSetAccess, entry points only through cuGetProcAddress. Copies on a
(non-blocking) stream complete only when that stream is synchronized, and queued work whose memory is
unmapped first is a sticky CUDA_ERROR_ILLEGAL_ADDRESS for the context. It counts calls, injects failures,
limits device memory, and counts the API violations it refused.

This module compiles it with g++ once per session, then runs the checks in one child process whose
LD_LIBRARY_PATH finds the fake first (the loader reads LD_LIBRARY_PATH at process start only, so this
pytest process cannot switch drivers). That process imports vpaged once and forks a fresh child per
check, with the check's environment: each check starts with the driver not yet loaded and reads its
own configuration. A check is a function `check(drv, rng)` registered with @fake_driver_check(**env); pytest
sees one test per check and reports the child's traceback (asserts rewritten as pytest does) and output.

After every check the runner asserts that the fake refused no call as a rule violation and that no
driver object is left: allocations, mappings, reservations, primary-context references, pushed contexts.

Device pointers under the fake are host addresses, so checks read and write pages with numpy. Views
(DLPack kDLCUDA) need a CUDA build of torch, so VirtualKVCache is checked here for its bookkeeping and
driver calls only; tests/memory/test_cuda_backend.py (marked gpu) covers data through torch on a real device.
"""

import ast
import ctypes
import faulthandler
import gc
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import vpaged
import vpaged._C as C
from vpaged import KVGeometry, VirtualCacheConfig
from vpaged.errors import (
    BackendError,
    BackendUnavailableError,
    InvalidArgumentError,
    MappingLimitError,
    OutOfPagesError,
)

ROOT = Path(__file__).resolve().parents[2]
FAKE_SOURCE = Path(__file__).resolve().parents[1] / "fake_cuda" / "fake_libcuda.cpp"
CHECK_TIMEOUT_S = 30  # per check, in its child

# CUresult and flag values (cuda.h).
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
CUDA_ERROR_UNKNOWN = 999
CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1
KDL_UINT = 1

ENTRY_POINTS = (
    "cuGetProcAddress",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease",
    "cuCtxGetCurrent",
    "cuCtxPushCurrent",
    "cuCtxPopCurrent",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemcpyDtoDAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyHtoDAsync",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuStreamIsCapturing",
)
VMM_CALLS = (
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
)
COPY_CALLS = ("cuMemcpyDtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync", "cuStreamSynchronize")
LIVE_OBJECTS = ("allocations", "mappings", "reservations", "primary_refs", "context_depth")
# What a process keeps once it has built a backend: one reference on the primary context, held to the end so
# that closing the last cache does not destroy the context (csrc/backends/cuda_backend.cpp).
AFTER_TEARDOWN = {**dict.fromkeys(LIVE_OBJECTS, 0), "primary_refs": 1}


# ---------------------------------------------------------------------------------------------------
# The fake driver's hooks, as a check sees them (in its child process).


class FakeDriver:
    """ctypes access to the fake_cuda_* hooks of the libcuda.so.1 that vpaged loads."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")  # the same library object vpaged dlopens (same soname)
        if not hasattr(lib, "fake_cuda_calls"):
            raise RuntimeError("libcuda.so.1 in this process is not the fake driver (check LD_LIBRARY_PATH)")
        lib.fake_cuda_calls.argtypes = [ctypes.c_char_p]
        lib.fake_cuda_calls.restype = ctypes.c_long
        lib.fake_cuda_live.argtypes = [ctypes.c_char_p]
        lib.fake_cuda_live.restype = ctypes.c_longlong
        lib.fake_cuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_int]
        lib.fake_cuda_set_memory_limit.argtypes = [ctypes.c_longlong]
        lib.fake_cuda_violations.restype = ctypes.c_long
        lib.fake_cuda_last_violation.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.fake_cuda_proc_flags.restype = ctypes.c_ulonglong
        lib.fake_cuda_push_primary.argtypes = [ctypes.c_int]
        lib.fake_cuda_stream_create.argtypes = [ctypes.c_int]
        lib.fake_cuda_stream_create.restype = ctypes.c_void_p
        lib.fake_cuda_launch_read.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        lib.fake_cuda_pending.argtypes = [ctypes.c_void_p]
        lib.fake_cuda_pending.restype = ctypes.c_long
        lib.fake_cuda_stream_synchronize.argtypes = [ctypes.c_void_p]
        lib.fake_cuda_sticky_error.argtypes = [ctypes.c_int]
        lib.fake_cuda_clear_sticky_error.argtypes = [ctypes.c_int]
        lib.fake_cuda_begin_capture.argtypes = [ctypes.c_void_p]
        lib.fake_cuda_begin_capture_mode.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.fake_cuda_end_capture.argtypes = [ctypes.c_void_p]
        self.lib = lib
        self.granularity = int(os.environ.get("FAKE_CUDA_GRANULARITY", 2 << 20))

    def calls(self, name: str) -> int:
        return self.lib.fake_cuda_calls(name.encode())

    def snapshot(self) -> dict:
        return {name: self.calls(name) for name in ENTRY_POINTS}

    def calls_since(self, before: dict, *names) -> dict:
        """Calls made since `before` (a snapshot), of the named entry points, leaving out those not called."""
        now = self.snapshot()
        return {n: now[n] - before[n] for n in names if now[n] != before[n]}

    def live(self, what: str) -> int:
        return self.lib.fake_cuda_live(what.encode())

    def live_objects(self) -> dict:
        return {what: self.live(what) for what in LIVE_OBJECTS}

    def fail(self, call: str, skip: int = 0, result: int = CUDA_ERROR_UNKNOWN) -> None:
        """Make the call of `call` after the next `skip` ones return `result`."""
        self.lib.fake_cuda_fail(call.encode(), skip, result)

    def set_memory_limit(self, nbytes) -> None:
        self.lib.fake_cuda_set_memory_limit(-1 if nbytes is None else int(nbytes))

    def violations(self) -> tuple[int, str]:
        buf = ctypes.create_string_buffer(512)
        self.lib.fake_cuda_last_violation(buf, len(buf))
        return self.lib.fake_cuda_violations(), buf.value.decode()

    def proc_flags(self) -> int:
        return self.lib.fake_cuda_proc_flags()

    def proc_version(self) -> int:
        return self.lib.fake_cuda_proc_version()

    def push_primary(self, device: int) -> None:
        """Make device's primary context current on this thread, as torch would."""
        assert self.lib.fake_cuda_push_primary(device) == 0

    def pop_primary(self) -> None:
        assert self.lib.fake_cuda_pop_primary() == 0

    def current_device(self) -> int:
        return self.lib.fake_cuda_current_device()

    def stream(self, device: int = 0) -> int:
        """A new non-blocking stream (as torch makes them); the handle as vpaged's calls take it."""
        return self.lib.fake_cuda_stream_create(device)

    def launch_read(self, stream: int, address: int, nbytes: int) -> int:
        """Queue a kernel on `stream` reading nbytes at address; returns the context's sticky error (0: none)."""
        return self.lib.fake_cuda_launch_read(stream, address, nbytes)

    def pending(self, stream: int) -> int:
        return self.lib.fake_cuda_pending(stream)

    def sync_stream(self, stream: int) -> int:
        return self.lib.fake_cuda_stream_synchronize(stream)

    def begin_capture(self, stream: int, mode: int = 0) -> None:
        """Make `stream` (one of drv.stream()) capture a CUDA graph until end_capture, in a capture mode (0 global,
        as torch.cuda.graph by default; 1 thread-local; 2 relaxed), from the calling thread."""
        assert self.lib.fake_cuda_begin_capture_mode(stream, mode) == 0

    def end_capture(self, stream: int) -> int:
        """End the capture: 0 when it is valid, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED when a call broke it."""
        return self.lib.fake_cuda_end_capture(stream)

    def sticky_error(self, device: int = 0) -> int:
        return self.lib.fake_cuda_sticky_error(device)

    def recover(self, device: int = 0) -> None:
        """Forget a sticky error and the violations provoked on purpose (the real driver needs a new process)."""
        self.lib.fake_cuda_clear_sticky_error(device)
        self.lib.fake_cuda_clear_violations()

    def assert_clean(self) -> None:
        count, last = self.violations()
        assert count == 0, f"the fake driver refused {count} call(s) as API violations; last: {last}"
        held = sum(C.cuda_primary_context_held(d) for d in range(C.cuda_device_count()))
        expected = {**dict.fromkeys(LIVE_OBJECTS, 0), "primary_refs": held}  # the process's own references
        left = {k: v for k, v in self.live_objects().items() if v != expected[k]}
        assert not left, f"driver objects left behind: {left}"


def host_bytes(address: int, n: int) -> np.ndarray:
    """A writable uint8 numpy view of n bytes at a (fake) device address."""
    return np.frombuffer((ctypes.c_uint8 * n).from_address(address), np.uint8)


def protection(address: int) -> str:
    """Permissions of the host mapping that holds address ('---p': reserved only, 'rw-s': a mapped page)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms
    return ""


def random_bytes(rng, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


def page_contents(pool, page) -> np.ndarray:
    out = np.empty(pool.page_size, np.uint8)
    pool.copy_to_host(page, out.ctypes.data)
    pool.backend.synchronize()
    return out


def make_pool(drv, capacity, reserve=0, batch=64, device=0):
    backend = C.cuda_backend(device, drv.granularity, capacity, reserve)
    return backend, C.PagePool(backend, 0, batch)


def run_in_thread(fn):
    """fn() in a new thread (which starts with no current context); returns its result or raises its error."""
    out = {}

    def body():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


# ---------------------------------------------------------------------------------------------------
# Registration, and the child-process runner.

CHECKS: dict = {}  # name -> (function, environment)


def check_registrar(checks: dict, results_fixture: str):
    """A decorator factory for a module's fake-driver checks: `@check(**env)` registers `check(drv, rng)` in
    `checks`, to run in a child under the fake driver with `env` set, and returns the pytest test that
    reports its outcome from the module's `results_fixture` (the fixture calling run_checks)."""

    def check_with(**env):
        def register(check):
            name = check.__name__
            checks[name] = (check, {k: str(v) for k, v in env.items()})

            def test(request):
                report(request.getfixturevalue(results_fixture), name)

            test.__name__ = test.__qualname__ = name
            test.__doc__ = check.__doc__
            return test

        return register

    return check_with


fake_driver_check = check_registrar(CHECKS, "fake_driver_results")


def _run_check_in_child(name: str) -> dict:
    check, env = CHECKS[name]
    with tempfile.TemporaryFile() as output:
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: run the check, send the outcome, never return
            os.close(read_end)
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
            try:
                os.environ.update(env)
                faulthandler.enable()  # a crash prints the Python stacks into the output
                faulthandler.dump_traceback_later(CHECK_TIMEOUT_S - 1)  # so does a hang, just before the alarm
                signal.alarm(CHECK_TIMEOUT_S)
                seed = int.from_bytes(os.urandom(8), "little")
                print(f"{name}: random seed {seed}, environment {env}")
                drv = FakeDriver()
                check(drv, np.random.default_rng(seed))
                gc.collect()
                drv.assert_clean()
                outcome = {"status": "ok"}
            except BaseException:  # noqa: BLE001 - reported to the parent
                outcome = {"status": "failed", "error": traceback.format_exc()}
            sys.stdout.flush()
            sys.stderr.flush()
            data = json.dumps(outcome).encode()
            while data:
                data = data[os.write(write_end, data) :]
            os._exit(0)
        os.close(write_end)
        chunks = []
        while chunk := os.read(read_end, 1 << 16):
            chunks.append(chunk)
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
        output.seek(0)
        text = output.read().decode(errors="replace")
    if chunks:
        result = json.loads(b"".join(chunks))
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        what = (
            f"timed out after {CHECK_TIMEOUT_S} s"
            if sig == signal.SIGALRM
            else f"was killed by {signal.Signals(sig).name}"
        )
        result = {"status": "crashed", "error": f"the check's process {what}"}
    else:
        code = os.waitstatus_to_exitcode(status)
        result = {"status": "crashed", "error": f"the check's process exited with status {code} without a report"}
    result["output"] = text[-20000:]
    return result


def _serve(result_path: str, names: list) -> None:
    # Objects that exist now (torch's, mostly) are never garbage: keep the children's gc.collect() cheap.
    gc.collect()
    gc.freeze()
    results = {name: _run_check_in_child(name) for name in names}
    Path(result_path).write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------------------
# Fixtures (in the pytest process): build the fake, run the selected checks once.


def cuda_home_found_by_setup():
    """setup.py's own find_cuda_home (extracted without running setup()): where the build found CUDA."""
    setup_py = ROOT / "setup.py"
    if not setup_py.is_file():
        pytest.skip("setup.py not found next to the tests (installed package)")
    tree = ast.parse(setup_py.read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("is_cuda_home", "find_cuda_home")]
    assert len(funcs) == 2, "setup.py no longer defines is_cuda_home and find_cuda_home"
    ns = {"os": os, "glob": glob, "shutil": shutil, "Path": Path}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(setup_py), "exec"), ns)
    return ns["find_cuda_home"]()


@pytest.fixture(scope="session")
def fake_driver_dir(tmp_path_factory) -> Path:
    """A folder holding the fake libcuda.so.1, compiled for this session."""
    if not C.built_with_cuda():
        pytest.skip("vpaged._C was built without CUDA: there is no CUDA backend to check")
    home = cuda_home_found_by_setup()
    if home is None or not (Path(home) / "include" / "cuda.h").is_file():
        pytest.skip(
            "no CUDA home with bin/nvcc and include/cuda.h (found as setup.py finds it): cannot compile the fake driver"
        )
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found: cannot compile the fake driver")
    out = tmp_path_factory.mktemp("fake_cuda")
    cmd = [
        cxx,
        "-std=c++17",
        "-O0",
        "-g",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        f"-I{Path(home) / 'include'}",
        str(FAKE_SOURCE),
        "-Wl,-soname,libcuda.so.1",
        "-o",
        str(out / "libcuda.so.1"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        pytest.fail(f"compiling the fake driver failed:\n{' '.join(cmd)}\n{proc.stderr}", pytrace=False)
    return out


def run_checks(request, driver_dir: Path, test_file: Path, checks: dict, extra_paths: tuple = ()) -> dict:
    """Run the checks of `checks` that pytest selected from `test_file` in one child process under the fake
    driver (`python test_file RESULT_JSON CHECK...`); returns {name: {status, error?, output}}."""
    names = [
        item.name
        for item in request.session.items
        if item.name in checks and Path(str(item.fspath)).resolve() == test_file
    ]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(driver_dir), env.get("LD_LIBRARY_PATH")) if p)
    # The child imports the same vpaged as this process.
    package_root = str(Path(vpaged.__file__).resolve().parent.parent)
    # The child sees the test helpers as pytest does (pyproject's pythonpath: tests/ and the shared areas).
    helpers = [str(p) for p in request.config.getini("pythonpath")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, *extra_paths, *helpers, env.get("PYTHONPATH")) if p)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "results.json"
        proc = subprocess.run(
            [sys.executable, str(test_file), str(result_path), *names],
            env=env,
            cwd=str(ROOT),
            capture_output=True,
            text=True,
            timeout=60 + 5 * len(names),
        )
        if proc.returncode != 0 or not result_path.is_file():
            pytest.fail(
                f"the fake-driver runner failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}", pytrace=False
            )
        return json.loads(result_path.read_text())


def report(results: dict, name: str) -> None:
    """Fail the calling test unless check `name` ran and passed in the child."""
    result = results.get(name)
    if result is None:
        pytest.fail(f"{name} did not run under the fake driver", pytrace=False)
    if result["status"] != "ok":
        pytest.fail(f"{result['error']}\n--- output of the check ---\n{result['output']}", pytrace=False)


@pytest.fixture(scope="session")
def fake_driver_results(request, fake_driver_dir) -> dict:
    """Outcome of every selected check: {name: {status, error?, output}}."""
    return run_checks(request, fake_driver_dir, Path(__file__).resolve(), CHECKS)


# ---------------------------------------------------------------------------------------------------
# Availability: every reason CUDA cannot be used is reported, typed, and the same everywhere.


@fake_driver_check(FAKE_CUDA_NO_DEVICE=1)
def test_driver_without_a_device_makes_cuda_unavailable(drv, rng):
    reason = C.cuda_unavailable_reason(0)
    assert reason.startswith("cuInit failed: CUDA_ERROR_NO_DEVICE"), reason
    assert (C.cuda_granularity(0), C.cuda_device_count()) == (0, 0)
    with pytest.raises(BackendUnavailableError) as info:
        C.cuda_backend(0, drv.granularity, 4)
    assert str(info.value) == reason
    assert vpaged.backends()["cuda"] == vpaged.BackendInfo("cuda", False, reason, 0, 0)
    with pytest.raises(BackendUnavailableError, match="^cannot use cuda:0: cuInit failed"):
        vpaged.PagePool("cuda", capacity_pages=4, page_size=drv.granularity)
    with pytest.raises(BackendUnavailableError, match="cuInit failed: CUDA_ERROR_NO_DEVICE"):
        vpaged.PagePool("cuda:0", capacity_pages=4)  # the default page size asks the driver first
    assert drv.calls("cuInit") == 1, "the driver is loaded and initialised once per process"


@fake_driver_check(FAKE_CUDA_DEVICES=2)
def test_device_out_of_range_is_unavailable(drv, rng):
    assert C.cuda_device_count() == 2
    assert C.cuda_unavailable_reason(1) == ""
    for missing in (2, 7, -1):
        reason = C.cuda_unavailable_reason(missing)
        assert reason == f"CUDA device {missing} does not exist (2 device(s) visible; see CUDA_VISIBLE_DEVICES)"
        assert C.cuda_granularity(missing) == 0
        with pytest.raises(BackendUnavailableError, match="does not exist"):
            C.cuda_backend(missing, drv.granularity, 4)
    backend = C.cuda_backend(1, drv.granularity, 2, 1)
    assert (backend.device, backend.created_pages) == ("cuda:1", 1)
    info = vpaged.backends()["cuda"]
    assert (info.usable, info.devices, info.granularity) == (True, 2, drv.granularity)
    with pytest.raises(BackendUnavailableError, match="^cannot use cuda:2: CUDA device 2 does not exist"):
        vpaged.PagePool("cuda:2", capacity_pages=1, page_size=drv.granularity)


@fake_driver_check(FAKE_CUDA_VMM=0)
def test_device_without_virtual_memory_management_is_unavailable(drv, rng):
    reason = C.cuda_unavailable_reason(0)
    assert reason == "CUDA device 0 does not support virtual memory management (cuMemCreate / cuMemMap)"
    assert (C.cuda_granularity(0), C.cuda_device_count()) == (0, 1)
    with pytest.raises(BackendUnavailableError, match="virtual memory management"):
        C.cuda_backend(0, drv.granularity, 4)
    info = vpaged.backends()["cuda"]
    assert (info.usable, info.reason) == (False, reason)


@fake_driver_check(FAKE_CUDA_MISSING="cuMemSetAccess")
def test_driver_missing_an_entry_point_is_unavailable(drv, rng):
    reason = C.cuda_unavailable_reason(0)
    assert "does not provide cuMemSetAccess for CUDA" in reason, reason
    assert "symbol status 1" in reason, reason  # CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
    assert drv.calls("cuInit") == 0, "a driver with entry points missing is never initialised"
    with pytest.raises(BackendUnavailableError, match="cuMemSetAccess"):
        C.cuda_backend(0, drv.granularity, 4)


@fake_driver_check(FAKE_CUDA_DRIVER_VERSION=11080)
def test_driver_older_than_the_api_vpaged_uses_is_unavailable(drv, rng):
    reason = C.cuda_unavailable_reason(0)
    assert "does not provide" in reason, reason  # cuGetProcAddress refuses an API newer than the driver
    assert drv.proc_version() > 11080 and drv.calls("cuInit") == 0
    assert (C.cuda_granularity(0), C.cuda_device_count()) == (0, 0)
    assert not vpaged.backends()["cuda"].usable


@fake_driver_check(FAKE_CUDA_GRANULARITY=4 << 20, FAKE_CUDA_GRANULARITY_NEEDS_CONTEXT=1)
def test_backends_report_cuda_usable_with_the_driver_granularity(drv, rng):
    """The granularity comes from the driver (4 MiB here), also from one that wants a context for the
    query: vpaged borrows the primary context for it and gives it back."""
    assert vpaged.backends()["cuda"] == vpaged.BackendInfo("cuda", True, "", 4 << 20, 1)
    assert drv.live("primary_refs") == 0 and drv.live("context_depth") == 0
    assert drv.calls("cuMemGetAllocationGranularity") >= 2  # refused without a context, answered with one
    assert drv.proc_flags() == CU_GET_PROC_ADDRESS_LEGACY_STREAM, "stream 0 must mean the legacy default stream"
    assert drv.proc_version() >= 12000
    pool = vpaged.PagePool("cuda", capacity_pages=3)
    assert (pool.page_size, pool.backend.device, pool.capacity_pages) == (4 << 20, "cuda:0", 3)
    assert drv.calls("cuInit") == 1


# ---------------------------------------------------------------------------------------------------
# Pages and the pool


@fake_driver_check()
def test_page_size_must_be_a_multiple_of_the_granularity(drv, rng):
    g = drv.granularity
    for bad in (0, g // 2, g + g // 2, g - 4096):
        with pytest.raises(InvalidArgumentError, match="granularity"):
            C.cuda_backend(0, bad, 4)
        assert drv.live("primary_refs") == 0 and drv.live("reservations") == 0
    with pytest.raises(InvalidArgumentError, match="capacity"):
        C.cuda_backend(0, g, 0)
    with pytest.raises(InvalidArgumentError):
        vpaged.PagePool("cuda", capacity_pages=2, page_size=g // 2)
    backend = C.cuda_backend(0, 2 * g, 4, 1)  # any multiple will do
    assert (backend.page_size, backend.created_pages) == (2 * g, 1)
    assert drv.live("allocations") == 1 and drv.live("allocated_bytes") == 2 * g
    with pytest.raises(InvalidArgumentError):
        backend.reserve(g)
    va = backend.reserve(4 * g)
    assert va % (2 * g) == 0
    backend.release(va, 4 * g)


@fake_driver_check()
def test_pool_creates_pages_ahead_in_batches(drv, rng):
    g = drv.granularity
    backend = C.cuda_backend(0, g, 10, 3)
    assert (backend.created_pages, drv.calls("cuMemCreate"), drv.calls("cuMemSetAccess")) == (3, 3, 1)
    assert drv.live("mappings") == drv.live("accessible_mappings") == 3  # the pool window
    pool = C.PagePool(backend, 0, 4)
    r = C.VirtualRange(pool, 12 * g)
    before = drv.snapshot()
    r.map_new([0, 1, 2, 3])  # 3 pages exist: the pool creates a batch of 4
    assert backend.created_pages == 7
    assert drv.calls_since(before, "cuMemCreate", "cuMemMap", "cuMemSetAccess") == {
        "cuMemCreate": 4,
        "cuMemMap": 4 + 4,
        "cuMemSetAccess": 1 + 1,
    }  # window batch, then the range's run
    r.map_new([4, 5, 6, 7])  # 3 free: a batch of 4 would pass the capacity, so 3
    assert backend.created_pages == 10
    before = drv.snapshot()
    with pytest.raises(OutOfPagesError):
        r.map_new([8, 9, 10])
    assert drv.calls_since(before, *VMM_CALLS) == {}
    st = pool.stats()
    assert (st.used_pages, st.created_pages, st.high_water_pages, st.total_pages) == (8, 10, 8, 10)
    assert r.pages_at([8, 9, 10]) == [-1, -1, -1]


@fake_driver_check()
def test_reserved_pages_are_created_once(drv, rng):
    backend = C.cuda_backend(0, drv.granularity, 100, 3)
    C.PagePool(backend, 3, 64)
    assert backend.created_pages == 3
    pool = vpaged.PagePool("cuda", capacity_pages=100, reserve_pages=4)
    assert pool.stats().created_pages == 4


@fake_driver_check()
def test_one_page_at_two_addresses_is_coherent(drv, rng):
    g = drv.granularity
    backend, pool = make_pool(drv, 8, 8)
    r1 = C.VirtualRange(pool, 4 * g)
    r2 = C.VirtualRange(pool, 2 * g)
    (page,) = r1.map_new([0])
    r1.map_shared([3], [page])
    r2.map_shared([1], [page])
    assert pool.refcount(page) == 3
    at0, at3, other = host_bytes(r1.address, g), host_bytes(r1.address + 3 * g, g), host_bytes(r2.address + g, g)
    data = random_bytes(rng, g)
    at0[:] = data
    assert np.array_equal(at3, data) and np.array_equal(other, data)
    data = random_bytes(rng, g)
    other[:] = data
    assert np.array_equal(at0, data)
    assert np.array_equal(page_contents(pool, page), data)  # and through the pool window
    assert [protection(r1.address + s * g) for s in range(4)] == ["rw-s", "---p", "---p", "rw-s"]
    del at0  # page index 0 is about to be unmapped: reading it then would fault
    r1.unmap([0])
    assert pool.refcount(page) == 2 and protection(r1.address) == "---p"
    assert np.array_equal(at3, data) and np.array_equal(other, data)


@fake_driver_check()
def test_copies_round_trip_through_the_pool_window(drv, rng):
    g = drv.granularity
    backend, pool = make_pool(drv, 4, 4)
    a, b, c = pool.acquire(3)
    src = random_bytes(rng, g)
    out = np.zeros(g, np.uint8)
    before = drv.snapshot()
    pool.copy_from_host(a, src.ctypes.data)
    pool.copy_page(b, a)
    pool.copy_to_host(b, out.ctypes.data)
    backend.synchronize(0)
    assert np.array_equal(out, src)
    assert drv.calls_since(before, *COPY_CALLS) == {
        "cuMemcpyHtoDAsync": 1,
        "cuMemcpyDtoDAsync": 1,
        "cuMemcpyDtoHAsync": 1,
        "cuStreamSynchronize": 1,
    }
    r = C.VirtualRange(pool, g)
    r.map_shared([0], [b])  # the copy landed in the page: seen at a range's address too
    assert np.array_equal(host_bytes(r.address, g), src)
    for bad in (4, 99, -1):  # 4: past the capacity
        with pytest.raises(InvalidArgumentError):
            pool.copy_page(b, bad)
        with pytest.raises(InvalidArgumentError):
            pool.copy_to_host(bad, out.ctypes.data)
        with pytest.raises(InvalidArgumentError):
            pool.copy_from_host(bad, src.ctypes.data)
    # discard_page (a page going free) is a no-op on CUDA: a freed page keeps its handle and its data; trim
    # releases the handle (tests/memory/test_cuda_budget_fake.py), and no copy reaches the page after that.
    pool.copy_from_host(c, src.ctypes.data)
    pool.decref(c)
    assert np.array_equal(page_contents(pool, c), src)
    assert pool.trim() == 2
    with pytest.raises(InvalidArgumentError, match="has no memory"):
        pool.copy_to_host(c, out.ctypes.data)
    pool.decref(a)
    pool.decref(b)


@fake_driver_check()
def test_copy_on_write_gives_the_page_index_a_private_copy(drv, rng):
    g = drv.granularity
    backend, pool = make_pool(drv, 8, 8)
    r = C.VirtualRange(pool, 2 * g)
    (page,) = r.map_new([0])
    r.map_shared([1], [page])
    data = random_bytes(rng, g)
    host_bytes(r.address, g)[:] = data
    used, m, u = pool.stats().used_pages, backend.map_calls, backend.unmap_calls
    before = drv.snapshot()
    fresh = r.copy_on_write(1)
    backend.synchronize()
    assert fresh != page and r.pages_at([0, 1]) == [page, fresh]
    assert (pool.refcount(page), pool.refcount(fresh), pool.stats().used_pages) == (1, 1, used + 1)
    assert (backend.map_calls - m, backend.unmap_calls - u) == (2, 1)
    assert drv.calls_since(before, "cuMemcpyDtoDAsync", "cuMemUnmap", "cuMemMap", "cuMemSetAccess") == {
        "cuMemcpyDtoDAsync": 1,
        "cuMemUnmap": 1,
        "cuMemMap": 1,
        "cuMemSetAccess": 1,
    }
    at0, at1 = host_bytes(r.address, g), host_bytes(r.address + g, g)
    assert np.array_equal(at1, data)
    at1[:] = random_bytes(rng, g)  # writing the copy leaves the original alone
    assert np.array_equal(at0, data) and np.array_equal(page_contents(pool, page), data)


@fake_driver_check()
def test_reorder_runs_shares_full_pages_and_copies_a_private_last_page(drv, rng):
    """A beam taking another's pages (VirtualRange.reorder_runs): full pages are remapped, the partly filled
    last page is copied device to device into the beam's own page, which keeps its mapping."""
    g = drv.granularity
    backend, pool = make_pool(drv, 16, 16)
    r = C.VirtualRange(pool, 8 * g)
    a = r.map_new([0, 1, 2])
    b = r.map_new([3, 4, 5])
    data = random_bytes(rng, 6 * g)
    host_bytes(r.address, 6 * g)[:] = data
    tail = int(rng.integers(1, g))
    before = drv.snapshot()
    assert r.reorder_runs([3], [0], [3], [3], [tail]) == 1
    backend.synchronize()
    assert r.pages_at([3, 4, 5]) == [a[0], a[1], b[2]]  # the last page stays the beam's own
    assert [pool.refcount(p) for p in a + b[2:]] == [2, 2, 1, 1]
    calls = drv.calls_since(before, "cuMemcpyDtoDAsync", "cuMemUnmap", "cuMemMap")
    assert calls == {"cuMemcpyDtoDAsync": 1, "cuMemUnmap": 2, "cuMemMap": 2}
    moved = host_bytes(r.address + 3 * g, 3 * g)
    assert np.array_equal(moved[: 2 * g + tail], data[: 2 * g + tail])
    # A swap's pages in one call: a run of consecutive pages into consecutive buffers is one copy.
    out = np.zeros(3 * g, np.uint8)
    before = drv.snapshot()
    pages = sorted(a)
    pool.copy_pages_to_host(pages, [out.ctypes.data + i * g for i in range(3)])
    backend.synchronize()
    runs = 1 + sum(1 for x, y in zip(pages, pages[1:]) if y != x + 1)
    assert drv.calls_since(before, "cuMemcpyDtoHAsync") == {"cuMemcpyDtoHAsync": runs}
    for i, p in enumerate(pages):
        assert np.array_equal(out[i * g : (i + 1) * g], page_contents(pool, p))
    del moved


@fake_driver_check()
def test_failed_copy_on_write_keeps_the_shared_page(drv, rng):
    g = drv.granularity
    backend, pool = make_pool(drv, 8, 8)
    r = C.VirtualRange(pool, 2 * g)
    (page,) = r.map_new([0])
    r.map_shared([1], [page])
    data = random_bytes(rng, g)
    host_bytes(r.address, g)[:] = data

    def state():
        return pool.stats().used_pages, pool.refcount(page), r.pages_at([0, 1]), r.mapped_pages, drv.live("mappings")

    before = state()
    drv.fail("cuMemMap")  # mapping the private copy fails: the shared page is mapped back
    with pytest.raises(BackendError, match="cuMemMap failed"):
        r.copy_on_write(1)
    assert state() == before
    assert protection(r.address + g) == "rw-s" and np.array_equal(host_bytes(r.address + g, g), data)
    drv.fail("cuMemcpyDtoDAsync")
    with pytest.raises(BackendError, match="cuMemcpyDtoDAsync failed"):
        r.copy_on_write(1)
    assert state() == before
    fresh = r.copy_on_write(1)  # the next attempt works
    assert r.page_at(1) == fresh and np.array_equal(host_bytes(r.address + g, g), data)


# ---------------------------------------------------------------------------------------------------
# Failures change nothing


@fake_driver_check()
def test_map_new_is_all_or_nothing(drv, rng):
    g = drv.granularity
    backend, pool = make_pool(drv, 8, 8)
    r = C.VirtualRange(pool, 8 * g)

    def state():
        return (
            pool.stats().used_pages,
            r.mapped_pages,
            r.pages_at(list(range(8))),
            drv.live("mappings"),
            [protection(r.address + s * g) for s in range(8)],
        )

    before = state()
    drv.fail("cuMemMap", skip=2)  # the third page of the run
    with pytest.raises(BackendError, match="cuMemMap failed: CUDA_ERROR_UNKNOWN"):
        r.map_new([0, 1, 2, 3])
    assert state() == before
    drv.fail("cuMemMap", skip=2)  # the first page of the second run: the first run is undone too
    with pytest.raises(BackendError, match="cuMemMap failed"):
        r.map_new([0, 1, 5, 6])
    assert state() == before
    drv.fail("cuMemSetAccess")
    with pytest.raises(BackendError, match="cuMemSetAccess failed"):
        r.map_new([2, 3])
    assert state() == before
    pages = r.map_new([0, 1, 2, 3])  # the retry works
    data = random_bytes(rng, 4 * g)
    host_bytes(r.address, 4 * g)[:] = data
    for i, p in enumerate(pages):
        assert np.array_equal(page_contents(pool, p), data[i * g : (i + 1) * g])
    assert drv.live("mappings") == 8 + 4


@fake_driver_check()
def test_map_shared_is_all_or_nothing(drv, rng):
    g = drv.granularity
    backend, pool = make_pool(drv, 8, 8)
    r1 = C.VirtualRange(pool, 4 * g)
    pages = r1.map_new([0, 1, 2])
    r2 = C.VirtualRange(pool, 4 * g)

    def state():
        return [pool.refcount(p) for p in pages], r2.mapped_pages, r2.pages_at([0, 1, 2, 3]), drv.live("mappings")

    before = state()
    drv.fail("cuMemMap", skip=1)
    with pytest.raises(BackendError, match="cuMemMap failed"):
        r2.map_shared([0, 1, 2], pages)
    assert state() == before
    with pytest.raises(InvalidArgumentError):
        r2.map_shared([0, 1], [pages[0], 7])  # page 7 is free: nothing may be taken
    assert state() == before
    r2.map_shared([0, 1, 2], pages)
    assert [pool.refcount(p) for p in pages] == [2, 2, 2]


@fake_driver_check()
def test_out_of_device_memory_raises_out_of_pages_and_changes_nothing(drv, rng):
    g = drv.granularity
    drv.set_memory_limit(5 * g)
    backend, pool = make_pool(drv, 16, 2, batch=4)
    r = C.VirtualRange(pool, 16 * g)
    r.map_new([0, 1, 2])  # 2 free: a batch of 4 is asked for and 3 fit
    assert backend.created_pages == 5

    def state():
        s = pool.stats()
        return (
            s.used_pages,
            s.free_pages,
            s.created_pages,
            r.mapped_pages,
            r.pages_at(list(range(16))),
            drv.live("mappings"),
            drv.live("allocations"),
        )

    before = state()
    with pytest.raises(OutOfPagesError, match="no memory for another page"):
        r.map_new([3, 4, 5])
    assert state() == before
    r.map_new([3, 4])  # the pages that exist are all still usable
    with pytest.raises(OutOfPagesError):
        r.map_new([5])
    drv.set_memory_limit(None)
    r.map_new([5])
    assert backend.created_pages == 9
    # Address space running out is a MappingLimitError, with the pool untouched.
    used = pool.stats().used_pages
    drv.fail("cuMemAddressReserve", result=CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(MappingLimitError, match="virtual address space"):
        C.VirtualRange(pool, g)
    assert pool.stats().used_pages == used
    # A backend that cannot create a single reserved page is not created at all; one that can create some
    # keeps those.
    drv.set_memory_limit(drv.live("allocated_bytes"))
    with pytest.raises(OutOfPagesError):
        C.cuda_backend(0, g, 4, 2)
    drv.set_memory_limit(drv.live("allocated_bytes") + g)
    assert C.cuda_backend(0, g, 4, 3).created_pages == 1


@fake_driver_check()
def test_failed_page_creation_loses_no_pages(drv, rng):
    g = drv.granularity
    backend, pool = make_pool(drv, 8, 2, batch=4)
    r = C.VirtualRange(pool, 8 * g)
    drv.fail("cuMemCreate", skip=1)  # the second page of the batch: a driver error, not out of memory
    with pytest.raises(BackendError, match="cuMemCreate failed: CUDA_ERROR_UNKNOWN"):
        r.map_new([0, 1, 2])
    assert (pool.stats().used_pages, r.mapped_pages) == (0, 0)
    assert backend.created_pages == 3  # the page made before the error is kept
    pages = r.map_new(list(range(8)))  # and handed out later, with the next batch
    assert backend.created_pages == 8 and sorted(pages) == list(range(8))


# ---------------------------------------------------------------------------------------------------
# Driver calls: counts, contexts, threads, teardown


def set_access_and_unmap_calls(drv):
    """Maps runs of pages and unmaps them; returns the backend, its pool, and (unmap calls the driver saw,
    the backend's unmap_calls) for unmapping a run of 5 pages and runs of 2 and 1."""
    g = drv.granularity
    before = drv.snapshot()
    backend, pool = make_pool(drv, 16, 0, batch=8)
    r = C.VirtualRange(pool, 16 * g)
    m0, u0 = backend.map_calls, backend.unmap_calls
    r.map_new([0, 1, 2, 3, 4])
    assert drv.calls_since(before, *VMM_CALLS) == {
        "cuMemAddressReserve": 2,
        "cuMemCreate": 8,
        "cuMemMap": 8 + 5,
        "cuMemSetAccess": 1 + 1,
    }
    assert backend.map_calls - m0 == 5 + 1  # pool-window mappings are not counted
    before = drv.snapshot()
    r.map_new([8, 9, 11])  # two runs: 8-9 and 11
    assert drv.calls_since(before, *VMM_CALLS) == {"cuMemMap": 3, "cuMemSetAccess": 2}
    assert backend.map_calls - m0 == 6 + 5
    before = drv.snapshot()
    r.unmap([4, 3, 2, 1, 0])
    r.unmap([11, 9, 8])
    assert drv.live("mappings") == 8  # the pool window's only
    calls = drv.calls_since(before, *VMM_CALLS)
    assert set(calls) == {"cuMemUnmap"}, calls
    return backend, pool, (calls["cuMemUnmap"], backend.unmap_calls - u0)


@fake_driver_check(FAKE_CUDA_MULTI_UNMAP=1)  # a driver that accepts a run of whole mappings in one call
def test_one_set_access_per_run_and_one_unmap_per_run(drv, rng):
    backend, pool, unmaps = set_access_and_unmap_calls(drv)
    assert unmaps == (1 + 2, 1 + 2) and pool.stats().unmap_fallbacks == 0


@fake_driver_check()
def test_a_refused_run_unmap_falls_back_to_one_call_per_page(drv, rng):
    # The strict fake, as the driver documents it: a run is refused, then each page goes with a call of its own.
    backend, pool, unmaps = set_access_and_unmap_calls(drv)
    assert unmaps == ((1 + 5) + (1 + 2) + 1,) * 2
    assert pool.stats().unmap_fallbacks == backend.unmap_fallbacks == 2 == drv.live("refused_unmaps")


@fake_driver_check(FAKE_CUDA_DEVICES=2)
def test_calls_from_any_thread_leave_its_current_context_alone(drv, rng):
    g = drv.granularity
    backend, pool = make_pool(drv, 8, 8)
    r = C.VirtualRange(pool, 8 * g)
    src = random_bytes(rng, g)

    def exercise(index):
        (p,) = r.map_new([index])
        pool.copy_from_host(p, src.ctypes.data)
        backend.synchronize()
        r.map_shared([index + 4], [p])
        r.copy_on_write(index + 4)
        assert np.array_equal(host_bytes(r.address + (index + 4) * g, g), src)
        r.unmap([index, index + 4])
        extra = C.VirtualRange(pool, g)  # reserve, map, unmap, release
        extra.map_new([0])
        del extra

    # A fresh thread has no current context, before or after.
    def fresh():
        first = drv.current_device()
        exercise(0)
        return first, drv.current_device(), drv.live("context_depth")

    assert run_in_thread(fresh) == (-1, -1, 0)

    # Another library (torch) keeps device 1 current on this thread: it stays current.
    def other_device_current():
        drv.push_primary(1)
        exercise(1)
        result = drv.current_device(), drv.live("context_depth")
        drv.pop_primary()
        return result

    assert run_in_thread(other_device_current) == (1, 1)

    # Device 0's primary context is current already: nothing is pushed.
    def same_device_current():
        drv.push_primary(0)
        pushes = drv.calls("cuCtxPushCurrent")
        exercise(2)
        pushes = drv.calls("cuCtxPushCurrent") - pushes
        drv.pop_primary()
        return pushes

    assert run_in_thread(same_device_current) == 0
    exercise(3)  # and the main thread
    assert drv.current_device() == -1

    # Ranges mapping and unmapping from several threads at once: the backend's counters stay exact.
    ranges = [C.VirtualRange(pool, 2 * g) for _ in range(4)]
    before, m0, u0 = drv.snapshot(), backend.map_calls, backend.unmap_calls

    def churn(rr):
        for _ in range(50):
            rr.map_new([0, 1])
            rr.unmap([0, 1])

    threads = [threading.Thread(target=churn, args=(rr,)) for rr in ranges]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    calls = drv.calls_since(before, "cuMemMap", "cuMemSetAccess", "cuMemUnmap")
    # Each unmap of two pages: the run refused as one call (the strict fake), then one call per page.
    assert calls == {"cuMemMap": 400, "cuMemSetAccess": 200, "cuMemUnmap": 600}
    assert (backend.map_calls - m0, backend.unmap_calls - u0) == (600, 600)
    assert backend.unmap_fallbacks == 200
    assert pool.stats().used_pages == 0


@fake_driver_check()
def test_the_primary_context_outlives_the_last_backend(drv, rng):
    """Closing the last pool must not destroy the primary context (on a GPU the next cache would create it
    again, 0.1-0.5 s, until torch holds a reference of its own): the process keeps one reference from its
    first backend on. A refused construction before any backend took none."""
    with pytest.raises(InvalidArgumentError, match="granularity"):
        C.cuda_backend(0, drv.granularity // 2, 4)
    assert drv.live("primary_refs") == 0 and not C.cuda_primary_context_held(0)
    for _ in range(3):
        backend, pool = make_pool(drv, 2, 1)
        assert C.cuda_primary_context_held(0)
        assert drv.live("primary_refs") == 2  # the backend's own and the process's
        del backend, pool
        gc.collect()
        assert drv.live_objects() == AFTER_TEARDOWN


@fake_driver_check()
def test_teardown_releases_every_driver_object(drv, rng):
    g = drv.granularity
    backend, pool = make_pool(drv, 8, 4)
    r1 = C.VirtualRange(pool, 4 * g)
    r2 = C.VirtualRange(pool, 4 * g)
    pages = r1.map_new([0, 1, 2])
    r2.map_shared([1, 3], [pages[0], pages[2]])
    r2.map_new([0])
    view = r2.view(0, [g], [1], KDL_UINT, 8)  # a DLPack capsule: keeps r2 alive
    assert drv.live_objects() == {
        "allocations": 4,
        "mappings": 4 + 3 + 3,
        "reservations": 3,
        "primary_refs": 2,  # the backend's and the process's
        "context_depth": 0,
    }
    del backend, pool  # the ranges keep pool and backend alive
    gc.collect()
    assert drv.live("allocations") == 4 and drv.live("primary_refs") == 2
    del r1
    gc.collect()
    assert (drv.live("mappings"), drv.live("reservations")) == (4 + 3, 2)
    del r2  # the view still holds it
    gc.collect()
    assert (drv.live("mappings"), drv.live("reservations")) == (4 + 3, 2)
    del view
    gc.collect()
    assert drv.live_objects() == AFTER_TEARDOWN

    # A backend whose construction fails part way leaves nothing behind either.
    for call, skip in (
        ("cuDevicePrimaryCtxRetain", 0),
        ("cuMemGetAllocationGranularity", 0),
        ("cuMemAddressReserve", 0),
        ("cuMemCreate", 1),
        ("cuMemMap", 1),
        ("cuMemSetAccess", 0),
    ):
        drv.fail(call, skip)
        with pytest.raises(BackendError, match=call):
            C.cuda_backend(0, g, 8, 3)
        assert drv.live_objects() == AFTER_TEARDOWN, call
        drv.lib.fake_cuda_clear_failures()


# ---------------------------------------------------------------------------------------------------
# VirtualKVCache on device="cuda": bookkeeping and driver calls (views need a CUDA build of torch)


class CurrentStream:
    """Stands in for torch's current CUDA stream (a CPU build of torch has none): the legacy default
    stream, handle 0. The cache registers it with its range, which waits for it (cuStreamSynchronize)
    before every unmap."""

    cuda_stream = 0


@fake_driver_check()
def test_virtual_kv_cache_steady_state_makes_no_driver_calls(drv, rng):
    """Deferred reclamation: a steady allocate/extend/free workload maps nothing after the first round
    and never waits on streams; reclaiming for another cache waits on the stream before unmapping."""
    g = drv.granularity
    torch.cuda.current_stream = lambda device=None: CurrentStream()  # this child process only
    # 8 heads x 128 x bf16: 1,024 tokens per page and region; 2 layers x K/V = 4 regions.
    cache = vpaged.VirtualKVCache(
        KVGeometry(2, 8, 128, torch.bfloat16),
        VirtualCacheConfig(max_seqs=4, max_seq_len=4096, device="cuda", capacity_bytes=64 * g),
    )
    assert cache.layout.tokens_per_page == 1024
    backend = cache.pool.backend
    prefill = int(rng.integers(925, 1000))  # + 100 decode steps crosses 1,024 tokens

    def serve_requests():
        seqs = [cache.allocate() for _ in range(4)]
        cache.extend_many(seqs, prefill)
        for _ in range(100):  # decode steps; the page boundary at 1,024 tokens is crossed once
            cache.extend_many(seqs, 1)
        for s in seqs:
            cache.free(s)

    serve_requests()
    assert backend.map_calls > 0
    before, m, u = drv.snapshot(), backend.map_calls, backend.unmap_calls
    serve_requests()
    serve_requests()
    assert drv.calls_since(before, *VMM_CALLS, *COPY_CALLS) == {}
    assert (backend.map_calls, backend.unmap_calls) == (m, u)  # and no cuStreamSynchronize (COPY_CALLS)
    st = cache.stats()
    assert (st.sequences, st.mapped_pages, st.dormant_pages) == (0, 32, 32)

    # A second cache on the same pool takes the first one's dormant pages back (waiting on the stream
    # before the first unmap), then runs out cleanly.
    other = vpaged.VirtualKVCache(
        KVGeometry(2, 8, 128, torch.bfloat16),
        VirtualCacheConfig(max_seqs=5, max_seq_len=4096, device="cuda"),
        pool=cache.pool,
    )
    seqs = [other.allocate() for _ in range(4)]
    unmaps = drv.calls("cuMemUnmap")
    drv.fail("cuStreamSynchronize")  # the wait comes first: when it fails, nothing has been unmapped
    with pytest.raises(BackendError, match="cuStreamSynchronize"):
        other.extend_many(seqs, 4096)
    assert drv.calls("cuMemUnmap") == unmaps and cache.stats().dormant_pages == 32
    assert all(other.seq_len(s) == 0 for s in seqs)
    syncs = drv.calls("cuStreamSynchronize")
    other.extend_many(seqs, 4096)  # 64 pages: the whole pool
    assert cache.stats().dormant_pages == 0 and drv.calls("cuMemUnmap") > unmaps
    assert drv.calls("cuStreamSynchronize") > syncs
    last = other.allocate()
    before_stats, before_calls = other.stats(), drv.snapshot()
    with pytest.raises(OutOfPagesError, match="nothing was changed"):
        other.extend(last, 1)
    assert other.seq_len(last) == 0 and other.stats() == before_stats
    assert drv.calls_since(before_calls, *VMM_CALLS) == {}
    other.close()
    cache.close()
    assert cache.pool.stats().used_pages == 0


@fake_driver_check()
def test_device_out_of_memory_reclaims_dormant_pages_first(drv, rng):
    g = drv.granularity
    torch.cuda.current_stream = lambda device=None: CurrentStream()  # this child process only
    drv.set_memory_limit(32 * g)  # the device holds half of what the pool may use
    pool = vpaged.PagePool("cuda", capacity_pages=64)
    first, second = (
        vpaged.VirtualKVCache(
            KVGeometry(2, 8, 128, torch.bfloat16),
            VirtualCacheConfig(max_seqs=4, max_seq_len=4096, device="cuda"),
            pool=pool,
        )
        for _ in range(2)
    )
    seqs = [first.allocate() for _ in range(4)]
    first.extend_many(seqs, 2048)  # 4 sequences x 4 regions x 2 pages: all the device memory
    for s in seqs:
        first.free(s)
    assert first.stats().dormant_pages == 32
    seq = second.allocate()
    second.extend(seq, 2048)  # needs 8 pages: only the dormant ones exist
    assert second.seq_len(seq) == 2048 and first.stats().dormant_pages < 32
    first.close()
    second.close()


@fake_driver_check()
def test_a_cache_on_a_cuda_pool_is_on_the_pools_device(drv, rng):
    torch.cuda.current_stream = lambda device=None: CurrentStream()  # this child process only
    pool = vpaged.PagePool("cuda", capacity_pages=8)
    cache = vpaged.VirtualKVCache(
        KVGeometry(1, 8, 128, torch.bfloat16), VirtualCacheConfig(max_seqs=2, max_seq_len=2048), pool=pool
    )
    assert cache.device == pool.device == torch.device("cuda", 0)
    with pytest.raises(InvalidArgumentError, match="pool is on cuda:0, device='cpu' asks for cpu"):
        vpaged.VirtualKVCache(
            KVGeometry(1, 8, 128, torch.bfloat16),
            VirtualCacheConfig(max_seqs=2, max_seq_len=2048, device="cpu"),
            pool=pool,
        )
    seq = cache.allocate()
    cache.extend(seq, 1500)
    assert cache.stats().mapped_pages == 4 and cache.pool.stats().used_pages == 4
    cache.close()


@fake_driver_check()
def test_failed_swap_in_waits_for_its_copies_before_unmapping(drv, rng):
    """swap_in's error path unmaps the fresh pages while host-to-device copies into them may still be
    queued: the range waits for the stream first (the fake records an unmap of memory with an unsynchronized
    copy as a violation, which the runner refuses)."""
    g = drv.granularity
    torch.cuda.current_stream = lambda device=None: CurrentStream()  # this child process only
    cache = vpaged.VirtualKVCache(
        KVGeometry(1, 8, 128, torch.bfloat16),
        VirtualCacheConfig(max_seqs=2, max_seq_len=4096, device="cuda", capacity_bytes=16 * g, swap_bytes=8 * g),
    )
    seq = cache.allocate()
    cache.extend(seq, int(rng.integers(1025, 4096)))  # 2 to 4 pages in each of the 2 regions
    swapped = cache.swap_out(seq) // g
    assert swapped >= 4 and cache.is_swapped(seq)
    before = cache.stats()
    drv.fail("cuMemcpyHtoDAsync", skip=int(rng.integers(1, swapped)))  # a later copy fails, earlier ones queued
    with pytest.raises(BackendError, match="cuMemcpyHtoDAsync"):
        cache.swap_in(seq)
    assert cache.is_swapped(seq) and cache.stats() == before
    cache.swap_in(seq)  # the swap space still holds the data: a second try works
    st = cache.stats()
    assert not cache.is_swapped(seq) and (st.swapped_sequences, st.live_tokens) == (0, cache.seq_len(seq))
    cache.close()


# ---------------------------------------------------------------------------------------------------
# Streams: asynchronous copies, kernels still queued at unmap, sticky errors


class FakeTorchStream:
    """Stands in for a torch.cuda.Stream under the fake driver: a fake stream whose synchronize() waits
    for the work queued on it."""

    def __init__(self, drv):
        self.drv = drv
        self.handle = drv.stream()
        self.cuda_stream = self.handle  # what the cache hands to its range (torch.cuda.Stream's name)

    def synchronize(self):
        assert self.drv.sync_stream(self.handle) == 0, "the stream's queued work faulted"


@fake_driver_check()
def test_copies_on_a_stream_land_only_when_that_stream_is_synchronized(drv, rng):
    """A copy on a caller's stream completes later than the call: the data is there after
    backend.synchronize(that stream), not before and not after synchronizing the legacy stream."""
    g = drv.granularity
    backend, pool = make_pool(drv, 4, 4)
    a, b = pool.acquire(2)
    stream = drv.stream()
    src = random_bytes(rng, g)
    out = np.zeros(g, np.uint8)
    old_a, old_b = page_contents(pool, a), page_contents(pool, b)  # legacy stream: done at the call
    pool.copy_from_host(a, src.ctypes.data, stream)
    pool.copy_page(b, a, stream)
    pool.copy_to_host(b, out.ctypes.data, stream)
    assert drv.pending(stream) == 3
    backend.synchronize(0)  # the legacy stream does not wait for a non-blocking stream
    assert drv.pending(stream) == 3 and not out.any()
    assert np.array_equal(page_contents(pool, a), old_a) and np.array_equal(page_contents(pool, b), old_b)
    backend.synchronize(stream)
    assert drv.pending(stream) == 0
    assert np.array_equal(out, src) and np.array_equal(page_contents(pool, b), src)


@fake_driver_check()
def test_unmapping_under_a_queued_kernel_is_a_sticky_illegal_address(drv, rng):
    """A kernel still queued on a stream when its pages are unmapped faults; the error is sticky: every later
    driver call of the context fails, and vpaged reports it as a BackendError that changes nothing."""
    g = drv.granularity
    backend, pool = make_pool(drv, 8, 8)
    r = C.VirtualRange(pool, 4 * g)
    r.map_new([0, 1])
    stream = drv.stream()
    assert drv.launch_read(stream, r.address, 2 * g) == 0
    backend.synchronize(stream)  # waited for: unmapping afterwards is fine
    r.unmap([1])
    assert drv.sticky_error() == 0
    assert drv.launch_read(stream, r.address, g) == 0
    r.unmap([0])  # the kernel is still queued: it faults
    assert drv.sticky_error() == CUDA_ERROR_ILLEGAL_ADDRESS
    assert "illegal address" in drv.violations()[1]
    before = (pool.stats().used_pages, r.mapped_pages, r.pages_at([0, 1, 2, 3]))
    with pytest.raises(BackendError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        r.map_new([2])
    with pytest.raises(BackendError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        backend.synchronize(0)
    out = np.zeros(g, np.uint8)
    with pytest.raises(BackendError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        pool.copy_to_host(0, out.ctypes.data)
    assert (pool.stats().used_pages, r.mapped_pages, r.pages_at([0, 1, 2, 3])) == before
    drv.recover()
    r.map_new([2])  # after a restart (modelled by recover) the driver works again


@fake_driver_check()
def test_copy_on_write_waits_for_a_stream_still_writing_the_source(drv, rng):
    """A page a declared stream is still writing (its work queued, as a kernel writing K/V would be) is copied
    only after that stream is done: the copy must not read the bytes from before the write. Both paths that
    copy pages: copy_on_write (one index) and make_private (several)."""
    g = drv.granularity
    backend, pool = make_pool(drv, 16, 16)
    r = C.VirtualRange(pool, 4 * g)
    r.map_new([0, 1, 2])
    side = drv.stream()
    r.add_stream(side)
    written = [random_bytes(rng, g) for _ in range(3)]
    for index, data in enumerate(written):
        pool.copy_from_host(r.page_at(index), data.ctypes.data, side)  # queued on the side stream
    assert drv.pending(side) == 3
    fresh = r.copy_on_write(0)
    assert np.array_equal(page_contents(pool, fresh), written[0])
    assert drv.pending(side) == 0
    for index, data in ((1, random_bytes(rng, g)), (2, random_bytes(rng, g))):
        written[index] = data
        pool.copy_from_host(r.page_at(index), data.ctypes.data, side)
    r.map_shared([3], [r.page_at(1)])  # index 1's page shared: make_private copies it
    pool.incref(r.page_at(2))  # held elsewhere too (as a prefix block would): copied as well
    held = r.page_at(2)
    assert r.make_private([1, 2]) == 2
    assert np.array_equal(page_contents(pool, r.page_at(1)), written[1])
    assert np.array_equal(page_contents(pool, r.page_at(2)), written[2])
    pool.decref(held)
    r.unmap([0, 1, 2, 3])
    assert pool.stats().used_pages == 0


# A driver that unmaps a run in one call: unmapped page by page, the fault below would be sticky part way through a
# run, leaving it half mapped, a state only a new process (not drv.recover) clears.
@fake_driver_check(FAKE_CUDA_MULTI_UNMAP=1)
def test_cache_waits_for_its_streams_before_unmapping(drv, rng):
    """VirtualKVCache's stream-safety protocol under a driver whose streams run late: kernels queued on the
    current and a declared side stream still read the pages that truncate/free/reclaim unmap; the cache
    waits for both streams first. Without that wait (the protocol switched off) the fake faults."""
    g = drv.granularity
    current, side = FakeTorchStream(drv), FakeTorchStream(drv)
    torch.cuda.current_stream = lambda device=None: current  # this child process only
    # interleaved: one run of pages per sequence, so a truncate is one cuMemUnmap
    cache = vpaged.VirtualKVCache(
        KVGeometry(1, 2, 128, torch.float32),
        VirtualCacheConfig(max_seqs=4, max_seq_len=8192, device="cuda", capacity_bytes=64 * g, layout="interleaved"),
    )
    cache.use_stream(side)
    lay = cache.layout
    seqs = [cache.allocate() for _ in range(3)]
    for s in seqs:
        cache.extend(s, int(rng.integers(4100, 8000)))  # more than one page per region

    def launch_reads(stream, seq):  # a decode kernel reading the sequence's K and V
        address = cache._range.address + lay.offset(0, 0, cache.slot(seq))
        assert drv.launch_read(stream.handle, address, cache.seq_len(seq) * lay.token_bytes) == 0

    for s in seqs:
        launch_reads(side, s)
        launch_reads(current, s)
    cache.truncate(seqs[1], 10)
    cache.free(seqs[2])
    cache.reclaim()
    assert drv.sticky_error() == 0 and drv.pending(side.handle) == drv.pending(current.handle) == 0
    assert drv.violations()[0] == 0

    # What the protocol guards against: unmapping without waiting (the range forgets the side stream).
    cache._range.remove_stream(side.handle)
    launch_reads(side, seqs[0])
    cache.truncate(seqs[0], 1)
    assert drv.sticky_error() == CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(BackendError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        cache.extend(seqs[1], 5000)
    drv.recover()
    cache.close()


@fake_driver_check()
def test_reclaim_during_a_graph_capture_never_waits_for_the_capturing_stream(drv, rng):
    """An allocation during a CUDA graph capture that needs pages another cache keeps for reuse: reclaiming
    them would unmap, which waits for the caches' streams, and a wait on the capturing stream breaks the
    capture. The pool skips that reclaim (OutOfPagesError, nothing changed) and gives back only what needs
    no unmap; a direct unmap is refused (BackendError); the capture survives; after it, the same
    allocation reclaims and succeeds."""
    current = FakeTorchStream(drv)
    torch.cuda.current_stream = lambda device=None: current  # this child process only
    pool = vpaged.PagePool("cuda", capacity_pages=16)
    first, second = (
        vpaged.VirtualKVCache(
            KVGeometry(1, 8, 128, torch.bfloat16),
            VirtualCacheConfig(max_seqs=4, max_seq_len=4096, device="cuda"),
            pool=pool,
        )
        for _ in range(2)
    )
    seqs = [first.allocate() for _ in range(4)]
    page_tokens = drv.granularity // (8 * 128 * 2)
    first.extend_many(seqs, int(rng.integers(page_tokens + 1, 2 * page_tokens + 1)))  # 4 x 2 regions x 2 pages
    live = seqs[0]
    for s in seqs[1:]:
        first.free(s)
    dormant = first.stats().dormant_pages
    assert dormant == 12 and pool.free_pages() == 0
    seq = second.allocate()

    drv.begin_capture(current.handle)
    with pytest.raises(OutOfPagesError):
        second.extend(seq, page_tokens)  # would reclaim dormant pages: refused during the capture
    with pytest.raises(BackendError, match="CUDA graph"):
        first.truncate(live, 1)  # an unmap of its own: refused before waiting
    assert second.seq_len(seq) == 0 and first.seq_len(live) > page_tokens
    assert first.stats().dormant_pages == dormant and pool.free_pages() == 0
    assert first._range.capturing() and first.reclaimable_pages() == 0
    assert drv.end_capture(current.handle) == 0, "a wait during the capture invalidated it"

    assert not first._range.capturing() and first.reclaimable_pages() == dormant
    second.extend(seq, page_tokens)  # reclaims now
    first.truncate(live, 1)
    assert second.seq_len(seq) == page_tokens and first.stats().dormant_pages < dormant
    first.close()
    second.close()


@fake_driver_check()
def test_gpu_cache_scenarios_keep_pool_and_cache_on_one_device(drv, rng):
    """tests/kvcache/test_cuda_cache.py's close scenario, run here without a GPU: the pool and the cache it builds
    must both be on cuda:0 (a cache without device= is on the CPU and refuses a CUDA pool)."""
    torch.cuda.current_stream = lambda device=None: CurrentStream()  # this child process only
    import test_cuda_cache  # on the child's path: pyproject's pythonpath (run_checks)

    pool = test_cuda_cache.close_scenario(torch.device("cuda", 0))
    assert pool.stats().created_pages >= 128 and pool.stats().used_pages == 0
    del pool


def _load_with_assertion_rewriting():
    """This module again, its asserts rewritten as pytest does on import, so that a failed assert in a
    check reports its operands (pytest's rewriter is internal API: fall back to this plain module)."""
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        source = Path(__file__).read_bytes()
        tree = ast.parse(source)
        rewrite_asserts(tree, source, __file__)
        module = types.ModuleType("test_cuda_backend_fake_rewritten")
        module.__file__ = __file__
        sys.modules[module.__name__] = module
        exec(compile(tree, __file__, "exec"), module.__dict__)
        return module
    except Exception:  # noqa: BLE001
        return sys.modules[__name__]


if __name__ == "__main__":  # the runner in the child process: python this_file RESULT_JSON CHECK...
    _load_with_assertion_rewriting()._serve(sys.argv[1], sys.argv[2:])
