"""The `vpaged` command."""

import json
import subprocess
import sys

from vpaged.cli import main
from vpaged.cli.demo import DemoConfig, run_demo


def test_demo_json_reports_consistent_numbers(capsys):
    assert main(["demo", "--steps", "300", "--seed", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["finished"] > 0 and r["peak_sequences"] > 0
    assert 0 < r["peak_live_bytes"] <= r["peak_mapped_bytes"] <= 1 << 30
    assert r["static_bytes_for_peak"] > r["peak_mapped_bytes"]
    assert 0 < r["mean_utilization"] <= 1


def test_demo_under_a_tight_budget_defers_instead_of_failing():
    r = run_demo(DemoConfig(steps=300, budget_bytes=32 << 20, arrival_rate=0.5, seed=1))
    assert r.deferred > 0
    assert r.peak_mapped_bytes <= 32 << 20


def test_console_entry_point_runs_the_demo_table():
    out = subprocess.run(
        [sys.executable, "-m", "vpaged.cli", "demo", "--steps", "100"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "static" in out.stdout and "utilization" in out.stdout


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    assert "backend cuda" in capsys.readouterr().out
