"""scripts/gpu_check.sh without a GPU: the dry run finishes in seconds, marks every stage skipped with the
reason, writes summary.json and exits 0; its stage caps fit its budget; every GPU test file has a stage."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def stages():
    """(name, cap, needs, command) of every `stage` line of the script."""
    out = []
    for line in SCRIPT.read_text().splitlines():
        m = re.match(r"^stage (\S+) (\d+) (\S+) (.+)$", line)
        if m:
            out.append((m[1], int(m[2]), m[3], m[4].strip("'")))
    return out


def run_dry(tmp_path, *args, **env):
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )
    return proc, time.monotonic() - t0, out


def check_dry_summary(out: Path, reason: str):
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["ok"] is True
    assert [s["stage"] for s in summary["stages"]] == [name for name, *_ in stages()]
    for s in summary["stages"]:
        assert s["status"] == "skipped", s
        assert reason in s["note"], s
    env = summary["environment"]
    assert env["python_executable"] == sys.executable and env["gpu_reason"]
    assert "dry run" in (out / "gpu_check.log").read_text()
    return summary


def test_dry_run_skips_every_stage_with_the_reason(tmp_path):
    proc, seconds, out = run_dry(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert seconds < 60  # a few seconds; generous for a busy CI machine
    summary = check_dry_summary(out, "dry run (--dry-run)")
    assert summary["caps_total_s"] == sum(cap for _, cap, *_ in stages())
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "summary.json"]


def test_machine_without_a_driver_is_a_dry_run(tmp_path):
    import vpaged._C as C

    if C.cuda_unavailable_reason(0) == "" or "libcuda.so.1 not found" not in C.cuda_unavailable_reason(0):
        pytest.skip("this machine has an NVIDIA driver: gpu_check.sh would run for real")
    proc, seconds, out = run_dry(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_dry_summary(out, "no NVIDIA driver")


def test_stage_caps_fit_the_budget():
    text = SCRIPT.read_text()
    budget = int(re.search(r"BUDGET=\$\{GPU_CHECK_BUDGET_S:-(\d+)\}", text)[1])
    reserve = int(re.search(r"REPORT_RESERVE=(\d+)", text)[1])
    caps = sum(cap for _, cap, *_ in stages())
    assert caps <= budget - reserve, f"stage caps add up to {caps}s, the budget leaves {budget - reserve}s"
    assert budget <= 360, "the whole check must end within 6 minutes of device time"


def test_every_gpu_test_file_has_its_own_stage():
    commands = [cmd for *_, cmd in stages()]
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if re.search(r"pytest\.mark\.gpu\b", path.read_text()):
            rel = f"tests/{path.name}"
            assert f"pytest_file {rel}" in commands, f"{rel} has GPU tests but no stage in gpu_check.sh"


def test_caps_leave_room_for_the_environment_probe_and_the_header_table_matches():
    """The caps' table in the script's header names every stage with its cap, and the sum, which leaves the
    environment probe's reserve free."""
    text = SCRIPT.read_text()
    budget = int(re.search(r"BUDGET=\$\{GPU_CHECK_BUDGET_S:-(\d+)\}", text)[1])
    reserve = int(re.search(r"REPORT_RESERVE=(\d+)", text)[1])
    probe = int(re.search(r"PROBE_RESERVE=(\d+)", text)[1])
    caps = sum(cap for _, cap, *_ in stages())
    assert caps <= budget - reserve - probe, f"caps {caps}s, budget {budget}s - report {reserve}s - probe {probe}s"
    table = dict(re.findall(r"^#   (\S+)\s+(\d+)\s{2,}\d+:", text, re.MULTILINE))
    assert {name: int(cap) for name, cap in table.items()} == {name: cap for name, cap, *_ in stages()}
    total = re.search(r"^#   caps' sum\s+(\d+)\s+of (\d+)", text, re.MULTILINE)
    assert total and (int(total[1]), int(total[2])) == (caps, budget)
