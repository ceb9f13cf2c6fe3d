"""benchmarks/bench_serve_vllm_online.py's own logic, without vLLM or a server: the servers run with their defaults
(only port, dtype and served name given), vLLM's client gets each section's workload, smoke runs scale it, and the
summary's ratios are the medians' ratios over the repeats."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_serve_vllm_online as online  # noqa: E402

sys.path.remove(str(BENCH))


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_servers_get_only_port_dtype_and_name():
    for arm in ("vpaged", "vllm"):
        cmd = online.server_command(arm, "/models/m", "bfloat16", 4321, "/vp/python", "/vl/python")
        assert cmd[0] == ("/vp/python" if arm == "vpaged" else "/vl/python")
        options = [c for c in cmd if c.startswith("--")]
        assert sorted(options) == sorted(
            ["--port", "--dtype", "--served-model-name"] + (["--model"] if arm == "vllm" else [])
        )
        assert flag(cmd, "--port") == "4321" and flag(cmd, "--dtype") == "bfloat16"
        assert flag(cmd, "--served-model-name") == online.SERVED_NAME
    env = online.server_env("vllm")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert str(online.ROOT) in online.server_env("vpaged")["PYTHONPATH"].split(":")  # vpaged from the repository


def test_the_client_runs_each_sections_workload(tmp_path):
    for name, section in online.SECTIONS.items():
        result = tmp_path / f"{name}.json"
        cmd = online.client_command("/vl/python", 999, "/models/m", section, 1, result)
        assert cmd[:2] == ["/vl/python", "-c"] and "from vllm.benchmarks.serve import" in cmd[2]
        assert flag(cmd, "--num-prompts") == str(section["prompts"])
        assert flag(cmd, "--random-input-len") == str(section["input_len"])
        assert flag(cmd, "--random-output-len") == str(section["output_len"])
        assert flag(cmd, "--request-rate") == str(section["rate"])
        assert flag(cmd, "--base-url") == "http://127.0.0.1:999" and flag(cmd, "--model") == online.SERVED_NAME
        assert flag(cmd, "--result-dir") == str(tmp_path) and flag(cmd, "--result-filename") == result.name
        assert "--ignore-eos" in cmd and flag(cmd, "--dataset-name") == "random" and flag(cmd, "--seed") == "1"
    assert online.SECTIONS["burst"]["rate"] == "inf"


def test_smoke_scaling_keeps_at_least_two_of_everything():
    s = online.scaled(online.SECTIONS["burst"], 0.001)
    assert s["prompts"] == s["input_len"] == s["output_len"] == 2 and s["rate"] == "inf"
    assert online.scaled(online.SECTIONS["rate"], 1.0) == online.SECTIONS["rate"]
    half = online.scaled(online.SECTIONS["burst"], 0.5)
    assert (half["prompts"], half["input_len"], half["output_len"]) == (16, 128, 32)


def test_summary_ratios_are_the_ratios_of_the_medians():
    rng = random.Random()
    runs, kept = [], {}
    for rep in range(3):
        for arm in ("vpaged", "vllm"):
            for section in ("burst", "rate"):
                client = {k: rng.uniform(1, 100) for k in online.FIELDS}
                runs.append({"round": rep, "arm": arm, "section": section, "client": client})
                kept.setdefault((section, arm), []).append(client)

    def med(section, arm, key):
        return statistics.median(c[key] for c in kept[(section, arm)])

    # A variant arm of vpaged's (a server with options of its own) gets the same ratios against vllm.
    for rep in range(2):
        for section in ("burst", "rate"):
            client = {k: rng.uniform(1, 100) for k in online.FIELDS}
            runs.append({"round": rep, "arm": "vpaged-2048", "section": section, "client": client})
            kept.setdefault((section, "vpaged-2048"), []).append(client)

    s = online.summarize(runs)
    variant = s["variant_ratios"]["vpaged-2048"]
    assert variant["burst_output_throughput_ratio"] == med("burst", "vpaged-2048", "output_throughput") / med(
        "burst", "vllm", "output_throughput"
    )
    assert variant["rate_mean_tpot_ratio"] == med("rate", "vpaged-2048", "mean_tpot_ms") / med(
        "rate", "vllm", "mean_tpot_ms"
    )
    assert set(s["variant_ratios"]) == {"vpaged-2048"}
    assert s["burst_output_throughput_ratio"] == med("burst", "vpaged", "output_throughput") / med(
        "burst", "vllm", "output_throughput"
    )
    assert s["rate_mean_tpot_ratio"] == med("rate", "vpaged", "mean_tpot_ms") / med("rate", "vllm", "mean_tpot_ms")
    assert s["rate_p99_ttft_ratio"] == med("rate", "vpaged", "p99_ttft_ms") / med("rate", "vllm", "p99_ttft_ms")
    assert s["medians"]["burst"]["vllm"]["duration"] == med("burst", "vllm", "duration")
    # One arm missing: no ratio, not a division by nothing.
    only = online.summarize([r for r in runs if r["arm"] == "vpaged"])
    assert only["burst_output_throughput_ratio"] is None and only["rate_mean_tpot_ratio"] is None


def test_variant_arms_add_their_options_to_their_server():
    variants = online.parse_variants(["vpaged-2048=--max-num-batched-tokens 2048", "vllm-eager=--enforce-eager"])
    assert variants == {"vpaged-2048": ["--max-num-batched-tokens", "2048"], "vllm-eager": ["--enforce-eager"]}
    cmd = online.server_command("vpaged-2048", "/m", "float32", 1, "/vp/python", "/vl/python", variants["vpaged-2048"])
    assert cmd[0] == "/vp/python" and flag(cmd, "--max-num-batched-tokens") == "2048"
    cmd = online.server_command("vllm-eager", "/m", "float32", 1, "/vp/python", "/vl/python", variants["vllm-eager"])
    assert cmd[0] == "/vl/python" and cmd[-1] == "--enforce-eager"
    assert online.server_env("vllm-eager")["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    with pytest.raises(ValueError, match="NAME=OPTIONS"):
        online.parse_variants(["vpaged-2048"])
    with pytest.raises(ValueError, match="start with vpaged or vllm"):
        online.parse_variants(["sglang=--x 1"])
