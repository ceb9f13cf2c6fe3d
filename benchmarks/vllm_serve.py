"""`vllm serve` with vpaged's plugin registered first, for a vLLM venv that does not have vpaged installed.

    VPAGED_VLLM=1 PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_serve.py --model DIR [vLLM's server options]

An installed vpaged registers its plugin through vLLM's `vllm.general_plugins` entry point in every process vLLM
starts; the venv of scripts/test_vllm.sh imports vpaged from the repository instead, so this registers it here
(register() does nothing unless VPAGED_VLLM=1), and vLLM's engine process, forked from this one (vLLM's CPU
default, VLLM_WORKER_MULTIPROC_METHOD=fork), inherits the hooks. Then it runs vLLM's OpenAI server as
`python -m vllm.entrypoints.openai.api_server` would.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    import vpaged.integrations.vllm as plugin

    plugin.register()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
