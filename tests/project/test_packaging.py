"""Packaging: the sdist and the wheel build from the checkout, install into fresh virtual environments and
work there; the build describes itself (vpaged.build_info(), `vpaged info`); CUDA architecture settings.

The install test compiles twice (a wheel from a copy of the checkout, with build isolation as
`pip install .` does; then the sdist from the archive alone) with VPAGED_CUDA=0 and VPAGED_CXXFLAGS=-O0 to
keep CI time modest: the CUDA kernels' nvcc pass would add minutes per build, and the CUDA build is covered
by the suite's own build. The fresh environments see torch and numpy through a .pth file naming this
environment's site-packages, instead of downloading them again; vpaged itself comes only from the
installed archive.
"""

import ast
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import vpaged
from vpaged import _C
from vpaged.cli import main
from vpaged.memory.buildinfo import build_info, describe_build

ROOT = Path(__file__).resolve().parents[2]


def setup_functions(*names):
    """Functions of setup.py (extracted without running setup()), with the module names they use."""
    setup_py = ROOT / "setup.py"
    if not setup_py.is_file():
        pytest.skip("setup.py not found next to the tests (installed package)")
    tree = ast.parse(setup_py.read_text())
    nodes = [
        n
        for n in tree.body
        if (isinstance(n, ast.FunctionDef) and n.name in names)
        or (isinstance(n, ast.Assign) and n.targets[0].id == "DEFAULT_CUDA_ARCHS")
    ]
    ns = {"os": os, "re": re, "ROOT": ROOT}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(setup_py), "exec"), ns)
    return ns


# ------------------------------------------------------------------------------------- build description


def test_build_info_describes_the_loaded_extension():
    info = build_info()
    assert info["version"] == vpaged.__version__
    assert info["cuda"] == _C.built_with_cuda()
    assert info["cxx"] and info["python"]
    if info["cuda"]:
        assert info["cuda_archs"] and all(re.fullmatch(r"sm_\d{2,3}[af]?", a) for a in info["cuda_archs"])
        assert info["nvcc"] and "release" in info["nvcc"]
        assert f"CUDA on ({', '.join(info['cuda_archs'])}" in describe_build(info)
    else:
        assert info["cuda_archs"] == [] and describe_build(info).startswith("CUDA off")


def test_info_command_reports_version_and_build(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert vpaged.__version__ in out and "build" in out and "CUDA" in out
    assert "backend cuda" in out


def test_cuda_architectures_default_and_override(monkeypatch):
    ns = setup_functions("cuda_archs", "ptx_arch", "nvcc_gencode")
    monkeypatch.delenv("VPAGED_CUDA_ARCHS", raising=False)
    assert ns["cuda_archs"]() == ["80", "90"]  # A100, H100/H200
    assert ns["nvcc_gencode"](["80", "90"]) == [
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-gencode",
        "arch=compute_90,code=sm_90",
        "-gencode",
        "arch=compute_90,code=compute_90",
    ]  # + PTX for newer GPUs
    for raw, expect in (
        ("90", ["90"]),
        ("8.0, 9.0", ["80", "90"]),
        ("sm_80;sm_90a", ["80", "90a"]),
        ("100 90 90", ["100", "90"]),
    ):
        monkeypatch.setenv("VPAGED_CUDA_ARCHS", raw)
        assert ns["cuda_archs"]() == expect, raw
    assert ns["nvcc_gencode"](["100", "90"])[-1] == "arch=compute_100,code=compute_100"  # PTX of the newest
    assert "code=compute" not in " ".join(ns["nvcc_gencode"](["90a"]))  # arch-specific code has no portable PTX
    for bad in ("ampere", "sm90", "9", ";"):
        monkeypatch.setenv("VPAGED_CUDA_ARCHS", bad)
        with pytest.raises(ValueError, match="VPAGED_CUDA_ARCHS"):
            ns["cuda_archs"]()


# ------------------------------------------------------------------------------------- sdist and wheel

ROUND_TRIP = r"""
import os, sys, torch, vpaged
assert os.path.realpath(vpaged.__file__).startswith(os.path.realpath(sys.prefix)), vpaged.__file__
assert vpaged.__version__ == vpaged.build_info()["version"]
config = vpaged.VirtualCacheConfig(max_seqs=4, max_seq_len=512, capacity_bytes=8 << 20)
cache = vpaged.VirtualKVCache(vpaged.KVGeometry(2, 2, 64, torch.float32), config)
g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
seq = cache.allocate()
cache.extend(seq, 300)
k, v = torch.randn(300, 2, 64, generator=g), torch.randn(300, 2, 64, generator=g)
cache.write(1, seq, k, v)
rk, rv = cache.kv(1, seq)
assert torch.equal(rk, k) and torch.equal(rv, v)
cache.close()
import vpaged.sim  # subpackages ship too
assert vpaged.sim.model_shape("Llama-3-8B").bytes_per_token == 128 << 10
print("round trip ok", vpaged.__file__)
"""


def run(cmd, cwd, env=None, timeout=900):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def checkout_copy(dest: Path) -> Path:
    """The files of the checkout (tracked ones where git knows them), without builds or environments."""
    try:
        files = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        files = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not {".git", ".venv", "build", "dist"} & set(p.relative_to(ROOT).parts)
        ]
    for f in files:
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def fresh_venv(path: Path) -> Path:
    """A new virtual environment that sees this one's packages (torch, numpy) after its own."""
    run([sys.executable, "-m", "venv", str(path)], cwd=path.parent)
    py = path / "bin" / "python"
    purelib = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], path).strip()
    # Plain directory lines: the .pth files there (this environment's editable vpaged) are not processed.
    (Path(purelib) / "outer_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return py


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """(sdist, wheel) built from a copy of the checkout: the wheel with build isolation."""
    tmp = tmp_path_factory.mktemp("dist")
    src = checkout_copy(tmp / "src")
    dist = tmp / "dist"
    env = {**os.environ, "VPAGED_CUDA": "0", "VPAGED_CXXFLAGS": "-O0"}
    run(
        [sys.executable, "-c", f"from setuptools import build_meta as b; print(b.build_sdist({str(dist)!r}))"], src, env
    )
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(src)], tmp, env)
    (sdist,) = dist.glob("vpaged-*.tar.gz")
    (wheel,) = dist.glob("vpaged-*.whl")
    return sdist, wheel


def test_sdist_holds_what_building_and_testing_need(dists):
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for need in (
        "LICENSE",
        "README.md",
        "setup.py",
        "pyproject.toml",
        "csrc/core/backend.h",
        "csrc/core/dlpack.h",
        "csrc/core/errors.h",
        "csrc/kernels/decode.h",
        "csrc/kernels/decode_cuda.cu",
        "csrc/bindings/build_info.cpp",
        "csrc/backends/cuda_backend.cpp",
        "benchmarks/csrc/bench_ext.cpp",
        "tests/conftest.py",
        "tests/fake_cuda/fake_libcuda.cpp",
        "examples/hf_generate.py",
        "scripts/gpu_check.sh",
        "vpaged/__init__.py",
    ):
        assert need in names, need
    assert not [n for n in names if n.endswith((".so", ".o"))]
    with tarfile.open(sdist) as tar:
        license_text = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/LICENSE"))).read()
    assert b"Apache License" in license_text and b"Version 2.0" in license_text


def test_wheel_holds_the_package_the_extension_and_the_metadata(dists):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "vpaged/__init__.py" in names and "vpaged/memory/buildinfo.py" in names
    assert [n for n in names if re.fullmatch(r"vpaged/_C\..*\.so", n)]
    assert not [n for n in names if n.startswith(("csrc/", "tests/"))]
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    plain = {re.split(r"[<>=; ]", r)[0] for r in requires if "extra ==" not in r}
    assert plain == {"torch", "numpy"}
    extras = {line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Provides-Extra:")}
    assert {"hf", "serve", "cuda", "plot"} <= extras

    def needs(extra):
        return {re.split(r"[<>=\[; ]", r)[0] for r in requires if f'extra == "{extra}"' in r}

    assert needs("hf") == {"transformers"}
    assert {"fastapi", "uvicorn", "pydantic", "vpaged"} <= needs("serve")
    assert needs("cuda") == {"cuda-bindings"} and needs("plot") == {"matplotlib"}
    assert f"Version: {vpaged.__version__}" in meta


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_package_works_in_a_fresh_environment(dists, kind, tmp_path):
    """The sdist compiles from the archive alone (pip, build isolation); the wheel installs as built."""
    sdist, wheel = dists
    py = fresh_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VPAGED_CUDA="0", VPAGED_CXXFLAGS="-O0")
    # --ignore-installed: the vpaged this environment sees through the .pth file is neither checked nor touched
    archive = wheel if kind == "wheel" else sdist
    run([str(py), "-m", "pip", "install", "--no-deps", "--ignore-installed", str(archive)], tmp_path, env)
    out = run([str(py), "-c", ROUND_TRIP], tmp_path, env)
    assert "round trip ok" in out and str(ROOT) not in out
    info = run([str(tmp_path / "venv" / "bin" / "vpaged"), "info"], tmp_path, env)
    assert vpaged.__version__ in info and "CUDA off" in info and "backend cpu" in info
    built = json.loads(
        run([str(py), "-c", "import json, vpaged; print(json.dumps(vpaged.build_info()))"], tmp_path, env)
    )
    assert built["version"] == vpaged.__version__ and built["cuda"] is False and "-O0" in built["cxxflags"]
