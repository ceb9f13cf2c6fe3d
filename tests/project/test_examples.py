"""The runnable examples run and say what they claim."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_hf_generate_example_matches_dynamic_cache():
    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_generate.py")], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    verdicts = [line.strip() for line in out.stdout.splitlines() if "same tokens as DynamicCache" in line]
    assert verdicts and all(v.endswith("True") for v in verdicts), out.stdout
    assert "after reset(): 0.00 MiB in use" in out.stdout
