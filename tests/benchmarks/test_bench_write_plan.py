"""benchmarks/bench_write_plan.py runs both arms on one cache and writes what it measured: a small run here, its file
checked for every batch size (times positive, the ratio consistent with them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_writes_both_arms_at_every_batch_size(tmp_path):
    out = tmp_path / "write-plan.json"
    script = str(ROOT / "benchmarks" / "bench_write_plan.py")
    cmd = [sys.executable, script, "--batch", "1,5", "--layers", "3", "--kv-heads", "2", "--head-dim", "16",
           "--context", "20", "--repeats", "3", "--output", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "write-plan" and data["layers"] == 3
    assert [r["batch"] for r in data["results"]] == [1, 5]
    for row in data["results"]:
        ms = row["ms"]
        assert set(ms) == {"write_kv per layer", "WritePlan"} and min(ms.values()) > 0
        assert row["plan_over_write_kv"] == pytest.approx(ms["WritePlan"] / ms["write_kv per layer"], abs=2e-3)
