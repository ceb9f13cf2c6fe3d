"""Build of vpaged._C: a plain pybind11 extension (no libtorch), plus CUDA sources when a CUDA home is found.

CUDA is compiled only where a directory holding both bin/nvcc and include/cuda.h exists (nvcc on PATH may be
a wrapper script, so the wrapper's own location proves nothing). VPAGED_CUDA=0 turns CUDA off. The CUDA driver
is never linked: the extension dlopens libcuda.so.1 at first use, so one build imports on any machine.

Settings (environment):
  VPAGED_CUDA=0          CPU-only build
  VPAGED_CUDA_ARCHS      GPU architectures of the CUDA kernels (default "80;90": A100, H100/H200; the PTX of the
                         newest is embedded too, so newer GPUs compile it at load). Compute capabilities separated
                         by ';', ',' or spaces, with or without a dot or "sm_": "90", "8.0 9.0", "sm_80,sm_90".
  VPAGED_BUILD_JOBS      parallel compile jobs (default 2)
  VPAGED_CXXFLAGS        extra C++ flags, after the defaults (e.g. "-O0" for a quick debug build)
The build writes what it did (version, CUDA on or off, architectures, compilers) into the extension itself:
vpaged.build_info() and `vpaged info` report it.
"""

import glob
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def pybind11_include() -> str:
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError:
        pass
    # torch ships the pybind11 headers; find them without importing torch.
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            inc = Path(loc) / "include"
            if (inc / "pybind11" / "pybind11.h").exists():
                return str(inc)
    raise RuntimeError("pybind11 headers not found: pip install pybind11 (or install torch, which ships them)")


def is_cuda_home(path) -> bool:
    p = Path(path)
    return (p / "bin" / "nvcc").is_file() and (p / "include" / "cuda.h").is_file()


def find_cuda_home():
    if os.environ.get("VPAGED_CUDA", "1") == "0":
        return None
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in candidates:
        if c and is_cuda_home(c):
            return Path(c).resolve()
    return None


class BuildExt(build_ext):
    def build_extensions(self):
        ext = self.extensions[0]
        cuda_home = find_cuda_home()
        # A CUDA and a CPU-only build differ in VPAGED_WITH_CUDA, which setuptools' up-to-date checks (file
        # times only) cannot see: rebuild everything when the mode changed since the last build here.
        mode = "cuda" if cuda_home else "cpu"
        marker = Path(self.build_temp) / "vpaged-build-mode"
        if not marker.exists() or marker.read_text() != mode:
            self.force = True
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(mode)
        jobs = build_jobs()
        workers = ThreadPoolExecutor(max_workers=jobs)
        cuda_objects = []  # nvcc runs alongside the C++ compiles; the link waits for it
        if cuda_home is not None:
            print(f"vpaged: building with CUDA from {cuda_home}")
            ext.define_macros.append(("VPAGED_WITH_CUDA", "1"))
            ext.include_dirs.append(str(cuda_home / "include"))
            cu_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu"))
            if cu_sources:
                cuda_objects = [workers.submit(self.nvcc_compile, cuda_home, src) for src in cu_sources]
                ext.extra_objects += [str(self.nvcc_object(src)) for src in cu_sources]
                lib = cuda_home / "lib64"
                if not lib.is_dir():
                    lib = cuda_home / "lib"
                ext.library_dirs.append(str(lib))
                ext.libraries += ["cudart_static", "rt", "pthread", "dl"]
        else:
            print("vpaged: no CUDA home with bin/nvcc and include/cuda.h (or VPAGED_CUDA=0): CPU-only build")
        ext.libraries.append("dl")
        self.describe_build(ext, cuda_home)
        self.compile_in_parallel(workers, cuda_objects)
        print(f"vpaged: compiling with {jobs} job(s) (VPAGED_BUILD_JOBS)")
        try:
            super().build_extensions()
            for f in cuda_objects:  # also when no C++ source needed compiling
                f.result()
        finally:
            workers.shutdown(wait=True)

    def describe_build(self, ext, cuda_home):
        """Generate build_info.h (csrc/bindings/build_info.cpp compiles it into the extension). Rewritten only when
        its content changes, so an unchanged build stays up to date."""
        archs = cuda_archs() if cuda_home else []
        info = {
            "version": read_version(),
            "cuda": cuda_home is not None,
            "cuda_archs": [f"sm_{a}" for a in archs],
            "ptx": f"compute_{ptx_arch(archs)}" if ptx_arch(archs) else None,
            "nvcc": tool_version([str(cuda_home / "bin" / "nvcc"), "--version"], "release") if cuda_home else None,
            "cxx": tool_version([self.compiler.compiler_so[0], "--version"]),
            "cxxflags": ext.extra_compile_args,
            "python": platform.python_version(),
            "platform": platform.machine(),
        }
        header = Path(self.build_temp) / "vpaged_generated" / "build_info.h"
        text = f'#define VPAGED_BUILD_INFO R"vpaged({json.dumps(info)})vpaged"\n'
        header.parent.mkdir(parents=True, exist_ok=True)
        if not header.exists() or header.read_text() != text:
            header.write_text(text)
        ext.include_dirs.append(str(header.parent))
        ext.depends.append(str(header))

    def compile_in_parallel(self, workers, cuda_objects):
        """Compile an extension's C++ sources on the `workers` threads (setuptools compiles them one at a
        time), then wait for the CUDA objects, so that the link that follows has every object."""
        compiler = self.compiler

        def compile_all(
            sources,
            output_dir=None,
            macros=None,
            include_dirs=None,
            debug=0,
            extra_preargs=None,
            extra_postargs=None,
            depends=None,
        ):
            macros, objects, extra, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs
            )
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

            def one(obj):
                src, src_ext = build[obj]
                compiler._compile(obj, src, src_ext, cc_args, extra, pp_opts)

            for done in [workers.submit(one, obj) for obj in objects if obj in build]:
                done.result()
            for f in cuda_objects:
                f.result()
            return objects

        compiler.compile = compile_all

    def nvcc_object(self, src: str) -> Path:
        # The architectures are part of the object's name: an object built for other GPUs is never reused.
        return Path(self.build_temp) / f"{src}.sm{'-'.join(cuda_archs())}.o"

    def nvcc_compile(self, cuda_home: Path, src: str) -> str:
        archs = cuda_archs()
        out = self.nvcc_object(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        gencode = nvcc_gencode(archs)
        cmd = [
            str(cuda_home / "bin" / "nvcc"),
            "-c",
            src,
            "-o",
            str(out),
            "-O3",
            "-std=c++17",
            "-Xcompiler",
            "-fPIC",
            "--expt-relaxed-constexpr",
            "-Icsrc",
            "-DVPAGED_WITH_CUDA=1",
            *gencode,
        ]
        if not (out.exists() and out.stat().st_mtime > max(Path(src).stat().st_mtime, newest_header())):
            print(" ".join(cmd))
            subprocess.check_call(cmd, cwd=ROOT)
        return str(out)


DEFAULT_CUDA_ARCHS = "80;90"  # A100; H100 and H200 (+ PTX of compute_90 for newer GPUs)


def cuda_archs() -> list:
    """VPAGED_CUDA_ARCHS as compute capabilities without the dot: "8.0, sm_90" -> ["80", "90"]."""
    raw = os.environ.get("VPAGED_CUDA_ARCHS") or DEFAULT_CUDA_ARCHS
    archs = []
    for token in re.split(r"[;,\s]+", raw.strip()):
        if not token:
            continue
        arch = token.lower().removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not re.fullmatch(r"\d{2,3}[af]?", arch):
            raise ValueError(f"VPAGED_CUDA_ARCHS: {token!r} is not a compute capability such as 80, 9.0 or sm_90a")
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise ValueError("VPAGED_CUDA_ARCHS names no architecture")
    return archs


def ptx_arch(archs):
    """The newest architecture without an a/f suffix (whose PTX newer GPUs can compile), or None."""
    plain = [a for a in archs if a.isdigit()]
    return max(plain, key=int) if plain else None


def nvcc_gencode(archs) -> list:
    """nvcc flags: machine code for each architecture, plus the PTX of the newest for GPUs not listed."""
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    ptx = ptx_arch(archs)
    if ptx:
        flags += ["-gencode", f"arch=compute_{ptx},code=compute_{ptx}"]
    return flags


def read_version() -> str:
    """vpaged/__init__.py's __version__: the one place the version is written (pyproject reads it too)."""
    text = (ROOT / "vpaged" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M)[1]


def tool_version(cmd, pick=None):
    """The first line of a tool's --version output (the first that contains `pick`, if given)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out if line.strip() and (pick is None or pick in line)]
    return lines[0] if lines else None


def build_jobs() -> int:
    """Parallel compile jobs: VPAGED_BUILD_JOBS, else 2 (a modest default for shared machines)."""
    try:
        return max(1, int(os.environ.get("VPAGED_BUILD_JOBS", "2")))
    except ValueError:
        return 2


def newest_header() -> float:
    return max((p.stat().st_mtime for p in (ROOT / "csrc").rglob("*.h")), default=0.0)


# Every C++ file under csrc/ (core, backends, kernels, torch_allocator, bindings) is part of vpaged._C; includes are
# relative to csrc/ ("core/page_pool.h"). Benchmark-only C++ lives in benchmarks/csrc/, outside the extension.
sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp"))

ext = Extension(
    "vpaged._C",
    sources=sources,
    include_dirs=[pybind11_include(), "csrc"],
    # Headers and CUDA sources: a change to any of them rebuilds and relinks the extension.
    depends=sorted(str(p.relative_to(ROOT)) for pattern in ("*.h", "*.cu") for p in (ROOT / "csrc").rglob(pattern)),
    language="c++",
    extra_compile_args=[
        "-std=c++17",
        "-O3",
        "-fvisibility=hidden",
        "-fopenmp",
        *shlex.split(os.environ.get("VPAGED_CXXFLAGS", "")),
    ],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
