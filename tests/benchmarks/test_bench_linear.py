"""benchmarks/bench_linear.py runs its arms on the same layers and writes what it measured: a small run here, its
file checked for every arm at every row count (times positive, ratios over the panel arm consistent with them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_writes_every_arm_at_every_row_count(tmp_path):
    out = tmp_path / "linear.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_linear.py"),
        "--rows",
        "1,7,70",
        "--layers",
        "2",
        "--hidden",
        "40",
        "--intermediate",
        "72",
        "--kv-width",
        "24",
        "--repeats",
        "2",
        "--threads",
        "1",
        "--output",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "linear" and data["layers"] == 2
    assert [r["rows"] for r in data["results"]] == [1, 7, 70]
    assert data["weight_bytes"] == 4 * 2 * (40 * 40 * 2 + 24 * 40 * 2 + 144 * 40 + 40 * 72)
    for row in data["results"]:
        assert {"panels", "F.linear"} <= set(row)
        base = row["panels"]["ms"]
        for arm in row:
            if arm == "rows":
                continue
            assert row[arm]["ms"] > 0
            # both figures rounded (ms to 4 places, the ratio to 3)
            assert row[arm]["over_panels"] == pytest.approx(row[arm]["ms"] / base, rel=0.01, abs=0.001 + 1e-4 / base)
