"""`vpaged bench`: runs the benchmark scripts, reads their JSON back, compares against the baselines."""

from __future__ import annotations

import ast
import json
import math
import random
import textwrap
from pathlib import Path

import pytest

from vpaged.cli import main as cli_main
from vpaged.cli.suite import SUITE, Row, summary_rows

MAPPING = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_mapping.py"


def _mapping_summary() -> str:
    """The real bench_mapping.py's summary_rows, for the stand-in script to export."""
    source = MAPPING.read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "summary_rows")
    return ast.get_source_segment(source, node)


def _fake_suite(tmp_path, mapping_us, fail_sharing=False):
    bench = tmp_path / "benchmarks"
    bench.mkdir(parents=True)
    (bench / "common.py").write_text("")
    raw, vp = mapping_us
    (bench / "bench_mapping.py").write_text(
        textwrap.dedent(f"""
        import json, os, sys
        assert sys.argv[1:] == ["--quick"], sys.argv
        out = os.environ["VPAGED_RESULTS_DIR"]
        data = {{"mapping": [{{"page_size": 65536, "raw_c_us": {raw}, "vpaged_1_us": {vp}}}],
                 "extend_256": {{"extend_many_us": 90.0, "extend_loop_us": 270.0}}}}
        open(os.path.join(out, "mapping_cpu.json"), "w").write(json.dumps(data))
        print("mapping done")
    """)
        + "\n\n"
        + _mapping_summary()
        + "\n"
    )
    (bench / "bench_sharing.py").write_text(
        "import sys; print('boom'); sys.exit(3)\n" if fail_sharing else "print('no json written')\n"
    )
    return bench


def test_bench_runs_scripts_and_compares(tmp_path, capsys):
    raw, vp = random.uniform(1, 10), random.uniform(1, 10)
    bench = _fake_suite(tmp_path, (raw, vp))
    out = tmp_path / "out"
    rc = cli_main(["bench", "--quick", "--only", "mapping", "--benchmarks", str(bench), "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["machine"]["cores"] >= 1 and "torch" in data["machine"]
    assert data["benchmarks"] == [
        {
            "name": "mapping",
            "status": "ok",
            "seconds": data["benchmarks"][0]["seconds"],
            "log": str(out / "logs" / "mapping.log"),
        }
    ]
    first = data["comparisons"][0]
    assert first["vpaged"] == pytest.approx(vp) and first["baseline"] == pytest.approx(raw)
    assert first["ratio"] == pytest.approx(vp / raw)
    assert data["comparisons"][1]["ratio"] == pytest.approx(90 / 270)
    assert (out / "logs" / "mapping.log").read_text().strip() == "mapping done"
    if (out / "bench_ratios.png").exists():
        assert (out / "bench_ratios.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_reports_failed_and_silent_scripts(tmp_path):
    bench = _fake_suite(tmp_path, (1.0, 1.2), fail_sharing=True)
    out = tmp_path / "out"
    assert (
        cli_main(["bench", "--only", "mapping,sharing", "--benchmarks", str(bench), "--out", str(out), "--quick"]) == 1
    )
    status = {b["name"]: b["status"] for b in json.loads((out / "bench.json").read_text())["benchmarks"]}
    assert status == {"mapping": "ok", "sharing": "failed (exit 3)"}
    bench2 = _fake_suite(tmp_path / "b", (1.0, 1.2))
    assert (
        cli_main(["bench", "--only", "sharing", "--benchmarks", str(bench2), "--out", str(tmp_path / "o2"), "--quick"])
        == 1
    )
    status = json.loads((tmp_path / "o2" / "bench.json").read_text())["benchmarks"][0]["status"]
    assert status.startswith("no results")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "mapping,warp"], "unknown benchmark(s) warp"),
        (["--benchmarks", "/nonexistent"], "no benchmark scripts at /nonexistent"),
        (["--timeout", "0"], "--timeout must be positive"),
    ],
)
def test_bench_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_every_suite_entry_names_an_existing_script():
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[2] / "benchmarks"
    for b in SUITE:
        if b.name == "serving" and not (bench_dir / b.script).exists():
            continue  # added with the serving engine
        assert (bench_dir / b.script).is_file(), b.script


def test_row_ratio():
    r = Row("x", "y", 3.0, 2.0, "base", "ms", "lower")
    assert r.ratio == 1.5
    assert math.isnan(Row("x", "y", 3.0, 0.0, "base", "ms", "lower").ratio)


def test_serving_rows_compare_each_backend_with_generate_batch():
    rates = {"vpaged": random.uniform(5, 50), "paged": random.uniform(5, 50), "generate_batch": random.uniform(5, 50)}
    data = {"throughput": {"rows": [{"kv": k, "output_tokens_per_s": v} for k, v in rates.items()]}}
    rows = {r.comparison: r for r in summary_rows("serving", data)}
    assert set(rows) == {"output tokens/s, engine kv=vpaged", "output tokens/s, engine kv=paged"}
    for kv in ("vpaged", "paged"):
        r = rows[f"output tokens/s, engine kv={kv}"]
        assert r.ratio == pytest.approx(rates[kv] / rates["generate_batch"]) and r.better == "higher"
    assert summary_rows("serving", {"throughput": {"rows": [{"kv": "vpaged", "output_tokens_per_s": 3.0}]}}) == []


@pytest.mark.parametrize("spelling", ["plain", "dotted", "home"])
def test_results_land_where_the_suite_reads_them_from_any_working_directory(tmp_path, monkeypatch, spelling):
    # Issue #35: `vpaged bench --quick --out results` from the repository root read ./results/ while the scripts,
    # run in benchmarks/, wrote benchmarks/results/: every benchmark said "no results (FileNotFoundError)".
    raw, vp = random.uniform(5, 10), random.uniform(10, 20)
    bench = _fake_suite(tmp_path / "checkout", (raw, vp))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("HOME", str(elsewhere))
    out = {"plain": "results", "dotted": "./sub/../results", "home": "~/results"}[spelling]
    rel_bench = "../checkout/benchmarks"
    rc = cli_main(["bench", "--quick", "--only", "mapping", "--benchmarks", rel_bench, "--out", out])
    assert rc == 0
    found = elsewhere / "results"
    assert json.loads((found / "mapping_cpu.json").read_text())["mapping"][0]["raw_c_us"] == raw
    data = json.loads((found / "bench.json").read_text())
    assert [b["status"] for b in data["benchmarks"]] == ["ok"]
    assert not (bench / "results").exists() and not (bench / "sub").exists()
