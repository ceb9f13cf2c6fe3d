"""The server builds its engines with one intra-op thread (loop.built_for_an_engine_thread), so that the thread
serving HTTP opens no OpenMP worker pool beside the engine thread's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

from vpaged.serve.http.loop import built_for_an_engine_thread  # noqa: E402


@pytest.fixture
def threads_kept():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_one_thread_inside_then_the_given_count(threads_kept):
    torch.set_num_threads(2)
    with built_for_an_engine_thread(3):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 3
    with built_for_an_engine_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 3  # None: what it was


def test_threads_come_back_when_the_build_fails(threads_kept):
    torch.set_num_threads(2)
    with pytest.raises(RuntimeError, match="model refused"), built_for_an_engine_thread(None):
        raise RuntimeError("model refused")
    assert torch.get_num_threads() == 2


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="an OpenMP worker pool needs two CPUs")
def test_building_an_engine_opens_no_worker_pool_on_the_building_thread():
    """In a fresh process: an engine built (and a large reduction run) under the context leaves the thread count
    of the process as it was; the same reduction after it, on the same thread, adds the pool's workers (the
    control: the count does see a pool)."""
    script = textwrap.dedent(
        """
        import os, torch
        from vpaged.serve import LLMEngine, load_model
        from vpaged.serve.http.loop import built_for_an_engine_thread
        def tasks():
            return len(os.listdir("/proc/self/task"))
        torch.set_num_threads(1)
        big = torch.ones(1 << 24)  # made with one thread: no pool yet
        torch.set_num_threads(2)
        before = tasks()
        with built_for_an_engine_thread():
            model, tokenizer = load_model("random:llama-tiny")
            engine = LLMEngine(model, tokenizer, kv_budget_bytes=8 << 20)
            big.sum()
        inside = tasks()
        big.sum()
        print(before, inside, tasks(), torch.get_num_threads())
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, inside, after, threads = map(int, out.stdout.split()[-4:])
    assert inside == before
    assert after > inside
    assert threads == 2
