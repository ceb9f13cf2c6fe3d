"""`vpaged serve --tensor-parallel-size 2` and `vpaged generate --tensor-parallel-size 2` on the CPU (gloo):
the server answers the official openai client, streaming and not, with the one-process engine's greedy text;
/metrics reports each rank and their sums; a killed rank makes the server answer 503 and exit non-zero."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from serve_helpers import save_model_with_tokenizer

from vpaged.cli import main

pytestmark = [
    pytest.mark.serving,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
TIMEOUT = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    save_model_with_tokenizer(path)
    return path


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def _spawned_ranks(pid: int) -> list[int]:
    """The processes a server spawned for its other ranks (not multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(x) for x in f.read().split()]
    ranks = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                ranks.append(child)
    return ranks


def test_generate_command_with_two_ranks_is_the_one_process_output(model_dir, capsys):
    common = ["generate", str(model_dir), "--prompt-ids", "5,6,7,8,9", "--max-tokens", "6", "--temperature", "0"]
    common += ["--ignore-eos", "--json", "--kv-budget-mib", "4", "--no-cpu-prepack"]
    assert main(common) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(common + ["--tensor-parallel-size", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["results"] == one["results"]
    assert two["stats"]["tensor_parallel_size"] == 2 and len(two["stats"]["ranks"]) == 2
    bench = ["bench-serve", "random:llama-tiny", "--num-requests", "4", "--min-prompt", "8", "--max-prompt"]
    bench += ["16", "--max-tokens", "4", "--kv-budget-mib", "2", "--json", "--no-progress", "--tensor-parallel-size"]
    assert main([*bench, "2"]) == 0
    r = json.loads(capsys.readouterr().out)["result"]
    assert r["requests"] == 4 and r["output_tokens"] == 16
    assert main(common + ["--tensor-parallel-size", "3"]) == 2
    assert "must divide" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_serve_with_two_ranks_answers_openai_and_dies_cleanly(model_dir, server_process):
    from vpaged.serve import LLM, SamplingParams

    reference = LLM(str(model_dir), kv_budget_bytes=4 << 20, cpu_prepack=False)
    expected = reference.generate("the cat sees", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    reference.engine.close()
    args = [str(model_dir), "--port", "0", "--served-model-name", "tiny", "--kv-budget-mib", "2"]
    args += ["--log-level", "warning", "--threads", "1", "--tensor-parallel-size", "2"]
    server = server_process(args, env={"VPAGED_TP_TIMEOUT_S": "20"})
    proc = server.proc
    try:
        server.ready(TIMEOUT)
        url = server.url
        greedy = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
            r = client.completions.create(prompt="the cat sees", **greedy)
            assert r.choices[0].text == expected[0].text and r.usage.completion_tokens == 6
            streamed = "".join(
                c.choices[0].text for c in client.completions.create(prompt="the cat sees", stream=True, **greedy)
            )
            assert streamed == expected[0].text
            chat = client.chat.completions.create(messages=[{"role": "user", "content": "a dog"}], **greedy)
            chunks = client.chat.completions.create(
                messages=[{"role": "user", "content": "a dog"}], stream=True, **greedy
            )
            assert (
                "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                == chat.choices[0].message.content
            )
        base = url.removesuffix("/v1")
        text = httpx.get(base + "/metrics", timeout=TIMEOUT).text
        assert _metric(text, "vpaged_tensor_parallel_size") == 2
        for total, per_rank in [("kv_mapped_bytes", "held_bytes"), ("kv_budget_bytes", "budget_bytes")]:
            ranks = [_metric(text, f"vpaged_rank_{per_rank}", f'{{rank="{r}"}}') for r in (0, 1)]
            assert _metric(text, f"vpaged_{total}") == sum(ranks) and ranks[0] == ranks[1]
        assert _metric(text, "vpaged_rank_budget_bytes", '{rank="1"}') == 2 << 20
        # Kill rank 1: the next request is answered 503 naming the rank, and the server exits non-zero.
        (worker,) = _spawned_ranks(proc.pid)
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(
            url + "/completions", json={"model": "tiny", "prompt": "the cat", "max_tokens": 4}, timeout=TIMEOUT
        )
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"], r.text
        proc.wait(30)
        assert time.monotonic() - t0 < 30
        assert proc.returncode not in (0, None)
        assert "rank 1" in proc.stderr.read()
    finally:
        server.kill()


TORCHRUN_SCRIPT = """
import json, sys
import torch
from vpaged.serve import LLM, SamplingParams
from vpaged.serve.distributed import run_worker

torch.set_num_threads(1)
prompts = [[5 + (7 * i + j) % 400 for j in range(10 + 9 * i)] for i in range(4)]
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
llm = LLM("random:llama-tiny", kv_budget_bytes=1 << 20, page_size=4096, cpu_prepack=False, tensor_parallel_size=2)
if llm.engine.rank != 0:  # the constructor returns on every rank; the others serve rank 0 until it closes
    run_worker(llm.engine)
    sys.exit(0)
outs = [o.token_ids for o in llm.generate(prompts, params)]
stats = llm.stats()
llm.engine.close()
print("RESULT " + json.dumps({"tokens": outs, "ranks": len(stats.ranks)}), flush=True)
"""


def test_torchrun_launch_matches_one_process(tmp_path):
    from vpaged.serve import LLM, SamplingParams

    script = tmp_path / "tp_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    env["VPAGED_TP_TIMEOUT_S"] = "60"
    with socket.socket() as sock:  # a free port for torchrun's store (port 0 would reach the ranks as 0)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    done = subprocess.run([*args, str(script)], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    got = json.loads(line[len("RESULT ") :])
    prompts = [[5 + (7 * i + j) % 400 for j in range(10 + 9 * i)] for i in range(4)]
    llm = LLM("random:llama-tiny", kv_budget_bytes=2 << 20, page_size=4096, cpu_prepack=False)
    expected = [
        o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    ]
    llm.engine.close()
    assert got == {"tokens": expected, "ranks": 2}


def test_torchrun_cli_rank_1_serves_rank_0_and_exits_0(capsys):
    """`torchrun -m vpaged.cli generate ... --tensor-parallel-size 2`: the engine's constructor returns on both
    ranks, rank 1 runs run_worker until rank 0 closes, and only rank 0 prints: the one-process result."""
    common = ["generate", "random:llama-tiny", "--prompt-ids", "5,6,7,8,9", "--max-tokens", "6", "--temperature"]
    common += ["0", "--ignore-eos", "--json", "--kv-budget-mib", "2", "--no-cpu-prepack"]
    assert main(common) == 0
    one = json.loads(capsys.readouterr().out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    env["VPAGED_TP_TIMEOUT_S"] = "60"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), "-m"]
    args += ["vpaged.cli", *common, "--tensor-parallel-size", "2", "--threads", "1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    start = done.stdout.index("{")
    two, end = json.JSONDecoder().raw_decode(done.stdout, start)
    assert "{" not in done.stdout[start + end :], "only rank 0 prints"
    assert two["results"] == one["results"] and len(two["stats"]["ranks"]) == 2
