"""The vLLM comparison rows of the benchmarks (benchmarks/vllm_peer.py, vllm_runner.py, bench_serve.py
--vllm-python): the runner's JSON protocol, the saved model directory, and the alternated rows, on a fake
interpreter that speaks the protocol; the real vLLM row only where VPAGED_VLLM_PYTHON names an interpreter
with vLLM's CPU build (nothing here installs vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import vllm_peer  # noqa: E402

sys.path.remove(str(BENCH))


def fake_python(tmp_path: Path, is_cpu: bool = True, fail_serve: bool = False, head_sizes=(16, 64)) -> Path:
    """An 'interpreter' that ignores the runner script it is given and answers as vllm_runner.py would: each
    request's completion is its last prompt token repeated, and the job it was sent is kept beside it."""
    log = tmp_path / "jobs"
    log.mkdir(exist_ok=True)
    script = tmp_path / "fake-python"
    script.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(f"""
        import json, os, sys, glob, shutil
        marker = {vllm_peer.RESULT_MARKER!r}
        runner, cmd, *rest = sys.argv[1:]
        assert runner.endswith("vllm_runner.py"), runner
        print("some vLLM log line on stdout")
        if cmd == "probe":
            facts = {{"vllm_version": "0.0-fake", "is_cpu": {is_cpu!r}, "platform": "Fake"}}
            facts["head_sizes"] = {list(head_sizes)!r}
            print(marker + json.dumps(facts))
            sys.exit(0)
        job = json.load(open(rest[0]))
        n = len(glob.glob({str(log)!r} + "/*.json"))
        shutil.copy(rest[0], {str(log)!r} + f"/{{n:03d}}.json")
        keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")
        env = {{k: os.environ.get(k) for k in keys}}
        json.dump(env, open({str(log)!r} + f"/{{n:03d}}.env", "w"))
        if {fail_serve!r}:
            print(marker + json.dumps({{"error": "RuntimeError: no CPU kernels"}}))
            sys.exit(1)
        outs = [[p[-1]] * job["max_tokens"] for p in job["prompts"]]
        print(marker + json.dumps({{
            "vllm_version": "0.0-fake", "load_seconds": 0.1, "seconds": 0.5, "steps": 3,
            "requests": len(outs), "output_tokens": sum(map(len, outs)), "outputs": outs,
            "ttft": [0.01] * len(outs), "tpot": [0.002] * len(outs), "finish_reasons": {{"length": len(outs)}},
        }}))
    """)
    )
    script.chmod(0o755)
    return script


def test_parse_result_takes_the_marked_line():
    out = "noise\n" + vllm_peer.RESULT_MARKER + '{"a": 1}\nmore noise\n'
    assert vllm_peer.parse_result(out) == {"a": 1}
    assert vllm_peer.parse_result("nothing here\n") is None


def test_root_cause_skips_engine_dead():
    err = (
        "(Worker pid=1) ERROR [x.py:1] Traceback (most recent call last):\n"
        "(Worker pid=1) ERROR [x.py:1] RuntimeError: Unsupported CPU attention configuration: head_dim=16\n"
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    )
    assert vllm_peer.root_cause(err) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16"
    assert vllm_peer.root_cause("EngineDeadError: x\n") is None


def test_runner_marker_matches(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import vllm_runner
    finally:
        sys.path.remove(str(BENCH))
    assert vllm_runner.RESULT_MARKER == vllm_peer.RESULT_MARKER


def test_real_runner_reports_missing_vllm():
    """The real runner under an interpreter without vLLM: one error line, exit 1, the reason in PeerError."""
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.skip("this interpreter has vLLM")
    facts, why = vllm_peer.probe(sys.executable, timeout=60)
    assert facts is None
    assert "vllm" in why.lower() and "ModuleNotFoundError" in why


def test_probe_refuses_a_non_cpu_build(tmp_path):
    facts, why = vllm_peer.probe(str(fake_python(tmp_path, is_cpu=False)))
    assert facts is None and "not its CPU build" in why
    facts, why = vllm_peer.probe(str(tmp_path / "no-such-python"))
    assert facts is None and "no interpreter" in why


def test_peer_env_binds_threads():
    env = vllm_peer.peer_env(2, 4)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "PYTHONPATH" not in env
    assert vllm_peer.peer_env(1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_prepare_model_dir_roundtrips_the_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from vpaged.serve import load_model

    model, _ = load_model("random:llama-tiny", dtype=torch.float32)
    d = vllm_peer.prepare_model_dir(model, tmp_path / "m")
    assert (d / "config.json").is_file() and list(d.glob("*.safetensors"))
    assert not list(d.glob("tokenizer*"))  # token ids only
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_key_value_heads"] == model.config.num_key_value_heads
    again = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def _bench_serve(tmp_path, *args, timeout=600):
    env = {**os.environ, "VPAGED_RESULTS_DIR": str(tmp_path / "results")}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_serve.py"), "--quick", "--output", "serve.json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "results" / "serve.json").read_text()), proc


def test_bench_serve_alternates_vllm_rows(tmp_path):
    py = fake_python(tmp_path)
    data, proc = _bench_serve(
        tmp_path,
        "--sections",
        "throughput,poisson",
        "--rows",
        "vpaged,vllm",
        "--repeats",
        "2",
        "--vllm-python",
        str(py),
        "--vllm-model-dir",
        str(tmp_path / "model"),
    )
    tp = data["throughput"]
    assert [(r["kv"], r["round"]) for r in tp["rows"]] == [("vpaged", 0), ("vllm", 0), ("vpaged", 1), ("vllm", 1)]
    assert tp["medians"]["vllm"]["runs"] == 2 and tp["medians"]["vllm"]["output_tokens_per_s"] > 0
    assert "vpaged_over_vllm" in tp["ratios"]
    cfg = data["config"]
    v = next(r for r in tp["rows"] if r["kv"] == "vllm")
    assert v["output_tokens"] == cfg["requests"] * cfg["max_tokens"]
    assert v["output_tokens_per_s"] == pytest.approx(v["output_tokens"] / 0.5)
    assert 0 <= v["same_tokens_as_vpaged"] <= cfg["requests"] and "common_prefix_tokens_mean" in v
    assert "outputs" not in v
    assert data["vllm"]["vllm_version"] == "0.0-fake"
    # the jobs the runner got: the throughput section's prompts (the same ids vpaged served), the model dir
    jobs = sorted((tmp_path / "jobs").glob("*.json"))
    assert len(jobs) == 3  # 2 throughput rounds + poisson
    job = json.loads(jobs[0].read_text())
    sys.path.insert(0, str(BENCH.parent))
    from vpaged.serve.bench import random_prompts

    assert job["prompts"] == random_prompts(cfg["requests"], cfg["min_prompt"], cfg["max_prompt"], 512, seed=0)
    assert job["max_tokens"] == cfg["max_tokens"] and job["dtype"] == "float32"
    assert job["max_model_len"] == max(map(len, job["prompts"])) + cfg["max_tokens"]
    assert Path(job["model_dir"]) == tmp_path / "model" and (tmp_path / "model" / "config.json").is_file()
    assert json.loads(jobs[0].with_suffix(".env").read_text()) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_ENABLE_V1_MULTIPROCESSING": None,  # vLLM's default: its engine core in a process of its own
    }
    pjob = json.loads(jobs[2].read_text())
    assert pjob["arrivals"] != [0.0] * len(pjob["arrivals"])
    kinds = [r["kv"] for r in data["poisson"]["rows"]]
    assert kinds == ["vpaged", "vllm", "paged"]
    pv = data["poisson"]["rows"][1]
    assert pv["ttft_p50"] == pytest.approx(0.01) and pv["tpot_p99"] == pytest.approx(0.002)


def test_bench_serve_sweeps_vllm_settings_as_rows(tmp_path):
    """vllm-bs<N> / -eager / -compiled rows run vLLM with those settings beside the plain vllm row, alternated
    with vpaged's; the ratios name the best of them."""
    py = fake_python(tmp_path)
    data, proc = _bench_serve(
        tmp_path,
        "--sections",
        "throughput",
        "--rows",
        "vpaged,vllm,vllm-bs32-eager,vllm-compiled-inproc",
        "--repeats",
        "2",
        "--vllm-python",
        str(py),
    )
    tp = data["throughput"]
    labels = ["vpaged", "vllm", "vllm-bs32-eager", "vllm-compiled-inproc"]
    assert [(r["kv"], r["round"]) for r in tp["rows"]] == [(k, n) for n in (0, 1) for k in labels]
    paths = sorted((tmp_path / "jobs").glob("*.json"))
    jobs = [json.loads(p.read_text()) for p in paths]
    assert [(j["block_size"], j["enforce_eager"]) for j in jobs] == [(None, False), (32, True), (None, False)] * 2
    envs = [json.loads(p.with_suffix(".env").read_text())["VLLM_ENABLE_V1_MULTIPROCESSING"] for p in paths]
    assert envs == [None, None, "0"] * 2
    by_label = {r["kv"]: r for r in tp["rows"]}
    assert by_label["vllm-bs32-eager"]["vllm_block_size"] == 32 and by_label["vllm-bs32-eager"]["vllm_enforce_eager"]
    assert by_label["vllm-compiled-inproc"]["vllm_inproc"] and not by_label["vllm"]["vllm_inproc"]
    vllm_rows = labels[1:]
    assert all(tp["medians"][k]["runs"] == 2 for k in vllm_rows)
    best = max(vllm_rows, key=lambda k: tp["medians"][k]["output_tokens_per_s"])
    assert tp["ratios"]["best_vllm_row"] == best
    vp = tp["medians"]["vpaged"]["output_tokens_per_s"]
    assert tp["ratios"]["vpaged_over_best_vllm"] == pytest.approx(vp / tp["medians"][best]["output_tokens_per_s"])
    assert tp["ratios"]["vpaged_over_vllm-bs32-eager"] == pytest.approx(
        vp / tp["medians"]["vllm-bs32-eager"]["output_tokens_per_s"]
    )
    assert all("same_tokens_as_vpaged" in r and "common_prefix_tokens_mean" in r for r in tp["rows"][1:4])


def test_vllm_row_names():
    sys.path.insert(0, str(BENCH))
    try:
        from bench_serve import FULL, vllm_row_settings
    finally:
        sys.path.remove(str(BENCH))
    cfg = dict(FULL, vllm_block_size=None, vllm_enforce_eager=0)
    assert vllm_row_settings("vllm", cfg) == cfg
    got = vllm_row_settings("vllm-bs16-eager-inproc", cfg)
    assert (got["vllm_block_size"], got["vllm_enforce_eager"], got["vllm_inproc"]) == (16, 1, 1)
    assert cfg["vllm_block_size"] is None and cfg["vllm_inproc"] == 0
    assert vllm_row_settings("vllm-compiled", dict(cfg, vllm_enforce_eager=1))["vllm_enforce_eager"] == 0
    for name in ("vpaged", "vllm-fast", "vllm-bs", "vllm-bsx", "vllm-tp2", "paged-eager"):
        assert vllm_row_settings(name, cfg) is None, name


def test_bench_serve_without_vllm_says_why(tmp_path):
    data, proc = _bench_serve(
        tmp_path, "--sections", "throughput", "--rows", "vpaged", "--vllm-python", str(fake_python(tmp_path, False))
    )
    assert "not its CPU build" in data["vllm"]["skipped"]
    assert [r["kv"] for r in data["throughput"]["rows"]] == ["vpaged"]
    assert "vllm row skipped" in proc.stderr


def test_bench_serve_refuses_a_head_dim_vllm_lacks(tmp_path):
    py = fake_python(tmp_path, head_sizes=[32, 64])
    data, proc = _bench_serve(tmp_path, "--sections", "throughput", "--rows", "vpaged,vllm", "--vllm-python", str(py))
    assert "head_dim [32, 64]" in data["vllm"]["skipped"] and "has 16" in data["vllm"]["skipped"]
    assert [r["kv"] for r in data["throughput"]["rows"]] == ["vpaged"]


def test_suite_reads_the_vllm_row():
    from vpaged.cli.suite import summary_rows

    d = {
        "throughput": {
            "rows": [{"kv": "vpaged", "output_tokens_per_s": 1.0}],
            "medians": {
                "vpaged": {"output_tokens_per_s": 30.0},
                "vllm": {"output_tokens_per_s": 20.0},
                "generate_batch": {"output_tokens_per_s": 25.0},
            },
        }
    }
    rows = {(r.comparison, r.baseline_name): (r.vpaged, r.baseline) for r in summary_rows("serving", d)}
    assert rows[("output tokens/s, engine kv=vpaged", "vLLM CPU")] == (30.0, 20.0)
    assert rows[("output tokens/s, engine kv=vpaged", "generate_batch")] == (30.0, 25.0)
    assert len(rows) == 2


def test_suite_passes_vllm_python(tmp_path):
    from vpaged.cli.suite import Bench, run_one

    bench = tmp_path / "b"
    bench.mkdir()
    (bench / "s.py").write_text(
        "import json, os, sys\n"
        "out = os.path.join(os.environ['VPAGED_RESULTS_DIR'], 'r.json')\n"
        "open(out, 'w').write(json.dumps({'argv': sys.argv[1:]}))\n"
        "\n"
        "def summary_rows(results):\n"
        "    return [dict(benchmark='serving', comparison=' '.join(results['argv']), vpaged=1.0, baseline=1.0,\n"
        "                 baseline_name='b', unit='tok/s', better='higher')]\n"
    )
    b = Bench("serving", "s.py", "r.json", ("--quick",), ())
    outcome = run_one(b, bench, tmp_path / "out", True, 60, "/x/python")
    assert outcome.status == "ok" and [r.comparison for r in outcome.rows] == ["--quick --vllm-python /x/python"]
    assert [r.comparison for r in run_one(b, bench, tmp_path / "out", True, 60).rows] == ["--quick"]


def test_bench_serve_vllm_failure_is_recorded(tmp_path):
    py = fake_python(tmp_path, fail_serve=True)
    data, proc = _bench_serve(tmp_path, "--sections", "throughput", "--rows", "vpaged,vllm", "--vllm-python", str(py))
    assert "no CPU kernels" in data["throughput"]["error"]


VLLM_PYTHON = os.environ.get("VPAGED_VLLM_PYTHON")


@pytest.mark.skipif(
    not VLLM_PYTHON, reason="set VPAGED_VLLM_PYTHON to an interpreter with vLLM's CPU build to run the real vllm row"
)
def test_real_vllm_row(tmp_path):
    facts, why = vllm_peer.probe(VLLM_PYTHON)
    if facts is None:
        pytest.skip(f"VPAGED_VLLM_PYTHON={VLLM_PYTHON}: {why}")
    # vLLM's CPU attention needs head_dim >= 32 (llama-tiny's is 16): bench-llama, a short workload
    data, proc = _bench_serve(
        tmp_path,
        "--sections",
        "throughput",
        "--rows",
        "vpaged,vllm",
        "--vllm-python",
        VLLM_PYTHON,
        "--set",
        "model=random:bench-llama",
        "--requests",
        "6",
        "--min-prompt",
        "32",
        "--max-prompt",
        "96",
        "--max-tokens",
        "8",
        timeout=1200,
    )
    tp = data["throughput"]
    assert "error" not in tp, tp
    v = next(r for r in tp["rows"] if r["kv"] == "vllm")
    cfg = data["config"]
    assert v["output_tokens"] == cfg["requests"] * cfg["max_tokens"]
    # fp32 on both sides on the same weights: greedy outputs mostly agree
    assert v["same_tokens_as_vpaged"] >= cfg["requests"] // 2, v
