"""serve() freezes what exists when it starts (the model, the tokenizer, the modules): the collector's full passes,
which stop every thread, the engine's included, then look only at what the requests made. Checked in a real
process (gc.freeze is process-wide): when the server is ready, the frozen objects outnumber the tracked ones
many times over, where before serve() the tracked ones are all there are.

A random-weight llama-tiny, one torch thread; the process stops itself with SIGTERM once it has reported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

SCRIPT = textwrap.dedent(
    """
    import gc, json, os, signal
    import torch
    torch.set_num_threads(1)
    from vpaged.serve import LLMEngine, load_model
    from vpaged.serve.http.server import serve

    model, tok = load_model("random:llama-tiny:7", dtype=torch.float32)
    engine = LLMEngine(model, tok, kv_budget_bytes=8 << 20, max_model_len=256, cpu_prepack=False)
    gc.collect()
    before = dict(frozen=gc.get_freeze_count(), tracked=len(gc.get_objects()))

    def ready(url):
        after = dict(frozen=gc.get_freeze_count(), tracked=len(gc.get_objects()))
        print(json.dumps(dict(before=before, after=after)), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    serve(engine, port=0, log_level="warning", on_ready=ready)
    """
)


def test_serve_freezes_what_exists_when_it_starts():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = report["before"], report["after"]
    assert before["frozen"] == 0 and before["tracked"] > 50_000
    # Everything alive before serve() is frozen; what the server made since (its app, uvicorn's objects) is not.
    assert after["frozen"] >= before["tracked"]
    assert after["tracked"] * 5 < after["frozen"]
