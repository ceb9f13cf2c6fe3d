"""How the installed extension was built: version, CUDA on or off, GPU architectures, compilers.

setup.py compiles this description into vpaged._C (csrc/build_info.cpp); it is read from that very binary,
so it describes the build that is loaded, whichever way it was installed.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re

from .. import _C


@functools.cache
def build_info() -> dict:
    """{"version", "cuda", "cuda_archs", "ptx", "nvcc", "cxx", "cxxflags", "python", "platform"}; for a build
    made without setup.py only "cuda" (from the extension) is known."""
    try:
        fn = ctypes.CDLL(_C.__file__).vpaged_build_info
        fn.restype = ctypes.c_char_p
        info = json.loads(fn().decode())
    except (AttributeError, OSError, ValueError):
        info = {}
    info.setdefault("cuda", bool(_C.built_with_cuda()))
    return info


def describe_build(info: dict | None = None) -> str:
    """One line: "CUDA on (sm_80, sm_90 + PTX compute_90; nvcc 13.0), gcc ..." or "CUDA off, gcc ..."."""
    info = build_info() if info is None else info
    if info.get("cuda"):
        archs = ", ".join(info.get("cuda_archs") or ["?"])
        ptx = f" + PTX {info['ptx']}" if info.get("ptx") else ""
        release = re.search(r"release ([\d.]+)", info.get("nvcc") or "")
        cuda = f"CUDA on ({archs}{ptx}; nvcc {release[1] if release else '?'})"
    else:
        cuda = "CUDA off"
    return f"{cuda}, {info.get('cxx') or 'compiler unknown'}"
