"""Each benchmark script exports `summary_rows(results)`, the comparisons its JSON holds; `vpaged bench` and
docs/numbers.md only collect them (suite.summary_rows). The rows of each script's committed results file are
checked against values read straight from that JSON here."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vpaged.cli import main as cli_main
from vpaged.cli import numbers, suite
from vpaged.errors import BenchmarkScriptError, InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _mapping(d):
    size = {64 << 10: "64 KiB", 2 << 20: "2 MiB"}
    rows = [(f"map + unmap one {size[m['page_size']]} page", m["vpaged_1_us"], m["raw_c_us"]) for m in d["mapping"]]
    ext = d["extend_256"]
    return rows + [("decode-step bookkeeping, 256 sequences", ext["extend_many_us"], ext["extend_loop_us"])]


def _sharing(d):
    return [
        ("copy-on-write of one page", d["cow"]["cow_us_per_page"], d["cow"]["plain_copy_us_per_page"]),
        ("swap out", d["swap"]["swap_out_GBps"], d["swap"]["plain_copy_GBps"]),
        *[
            (f"parallel sampling n={p['n']}: KV memory", p["shared_MiB"], p["unshared_MiB"])
            for p in d["parallel_sampling"]
        ],
        (
            f"{d['system_prompt']['requests']} requests, shared system prompt: KV memory",
            d["system_prompt"]["shared_MiB"],
            d["system_prompt"]["unshared_MiB"],
        ),
    ]


def _decode(d):
    return [
        (
            f"{c['dtype']} {c['batch']} x {c['context']} tokens",
            c["kernels"]["contiguous"]["median_ms"],
            c["kernels"]["paged"]["median_ms"],
        )
        for c in d["cells"]
    ]


def _hf(d):
    step = {(r["kind"], r["context"]): r["step_ms"] for r in d["decode"]}
    rows = [
        (f"decode step at {ctx} tokens", step["vpaged", ctx], step[base, ctx])
        for ctx in sorted({c for _, c in step})
        for base in ("dynamic", "static")
    ]
    # The file has beams of several model shapes; the summary reads the last of each cache kind.
    vp = [r for r in d["beam"] if r["kind"] == "vpaged"][-1]
    dyn = [r for r in d["beam"] if r["kind"] == "dynamic"][-1]
    shape = f"beam search {vp['beams']}x{vp['context']}"
    return rows + [
        (f"{shape}: reorder", vp["reorder_ms"], dyn["reorder_ms"]),
        (f"{shape}: peak KV", vp["peak_kv_mib"], dyn["peak_kv_mib"]),
    ]


def _serve(d):
    med = {kv: m["output_tokens_per_s"] for kv, m in d["throughput"]["medians"].items()}
    return [
        (f"output tokens/s, engine kv={kv}", med[kv], med["generate_batch"]) for kv in ("paged", "vpaged", "static")
    ]


def _elastic(d):
    st, sh = d["results"]["static"], d["results"]["shared"]
    rows = [
        ("TTFT p99 of the finished requests, 3 engines, bursty", sh["ttft_p99"], st["ttft_p99"]),
        ("output tokens/s, 3 engines, bursty", sh["output_tokens_per_s"], st["output_tokens_per_s"]),
    ]
    if "finished" in sh:
        rows.append((f"requests finished (of {sh['requests']}), 3 engines, bursty", sh["finished"], st["finished"]))
    return rows


# Each suite benchmark -> a committed results file of it, and its (comparison, vpaged, baseline) from the JSON.
COMMITTED = {
    "mapping": ("mapping_quick_xeon-avx512-2c.json", _mapping),
    "sharing": ("sharing_runs-loaded_epyc-avx2-2c.json", _sharing),
    "decode": ("decode_quick-cell-floor_xeon-avx512-2c.json", _decode),
    "transformers": ("hf_beam-attn-quick_epyc-zen4-avx512-2c.json", _hf),
    "serving": ("serve_throughput-rows_epyc-avx2-2c.json", _serve),
    "elastic": ("elastic_bursty-1.5mib_epyc-avx2-2c.json", _elastic),
}


def _summary_source(script: Path) -> str:
    source = script.read_text()
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "summary_rows")
    return ast.get_source_segment(source, node)


def test_every_suite_benchmark_has_a_committed_results_file():
    assert set(COMMITTED) == {b.name for b in suite.SUITE}


@pytest.mark.parametrize("bench", suite.SUITE, ids=lambda b: b.name)
def test_script_exports_summary_rows_and_runs_only_as_a_script(bench):
    tree = ast.parse((BENCHMARKS / bench.script).read_text())
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert "summary_rows" in names, bench.script
    # Reading rows must not start the benchmark: the script's work runs under the __main__ guard only.
    guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert len(guards) == 1, bench.script
    outside = [n for n in tree.body if n not in guards]
    starts = [
        ast.unparse(c)
        for n in outside
        for c in ast.walk(n)
        if isinstance(c, ast.Call) and ast.unparse(c.func) == "main"
    ]
    assert starts == [], f"{bench.script} calls {starts} outside its __main__ guard"


@pytest.mark.parametrize("bench", suite.SUITE, ids=lambda b: b.name)
def test_summary_rows_of_the_committed_results(bench):
    name, reference = COMMITTED[bench.name]
    data = _load(name)
    rows = suite.summary_rows(bench.name, data)
    assert [(r.comparison, r.vpaged, r.baseline) for r in rows] == reference(data)
    assert {r.benchmark for r in rows} == {bench.name}
    # The plain dicts the script gives are exactly the Row fields.
    dicts = suite.summary_function(bench)(data)
    assert [suite.Row(**d) for d in dicts] == rows
    assert all(r.better in ("lower", "higher") for r in rows)


def test_serving_summary_compares_with_vllm_when_the_run_had_it():
    data = _load("serve_vllm-throughput_epyc-2c.json")
    med = data["throughput"]["medians"]
    rows = suite.summary_rows("serving", data)
    assert [(r.comparison, r.vpaged, r.baseline, r.baseline_name) for r in rows] == [
        (
            "output tokens/s, engine kv=vpaged",
            med["vpaged"]["output_tokens_per_s"],
            med["vllm"]["output_tokens_per_s"],
            "vLLM CPU",
        )
    ]


def test_serving_summary_names_the_dtype_and_how_each_vllm_row_ran():
    data = _load("serve_throughput-bfloat16-generate-vs-runner_epyc-zen4-avx512bf16-2c.json")
    med = data["throughput"]["medians"]
    rows = suite.summary_rows("serving", data)
    vp = med["vpaged"]["output_tokens_per_s"]
    assert [(r.comparison, r.vpaged, r.baseline, r.baseline_name) for r in rows] == [
        (
            "output tokens/s, engine kv=vpaged, bfloat16",
            vp,
            med["vllm-bs32-eager-generate"]["output_tokens_per_s"],
            "vLLM CPU vllm-bs32-eager-generate, LLM.generate",
        ),
        (
            "output tokens/s, engine kv=vpaged, bfloat16",
            vp,
            med["vllm-bs32-eager"]["output_tokens_per_s"],
            "vLLM CPU vllm-bs32-eager, LLMEngine stepped",
        ),
    ]


def test_bench_prints_the_rows_each_script_summarises(tmp_path, capsys):
    # Scripts that stand in for the real ones: each "runs" by copying its committed results file where the
    # suite reads it, and carries the real script's summary_rows.
    fake = tmp_path / "benchmarks"
    fake.mkdir()
    (fake / "common.py").write_text("")
    for bench in suite.SUITE:
        committed = RESULTS / COMMITTED[bench.name][0]
        (fake / bench.script).write_text(
            "import os, shutil\n"
            f"shutil.copy({str(committed)!r}, os.path.join(os.environ['VPAGED_RESULTS_DIR'], {bench.result!r}))\n\n\n"
            + _summary_source(BENCHMARKS / bench.script)
            + "\n"
        )
    out = tmp_path / "out"
    names = ",".join(b.name for b in suite.SUITE)
    assert cli_main(["bench", "--only", names, "--benchmarks", str(fake), "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert [b["status"] for b in report["benchmarks"]] == ["ok"] * len(suite.SUITE)
    expected = [(b.name, *row) for b in suite.SUITE for row in COMMITTED[b.name][1](_load(COMMITTED[b.name][0]))]
    got = [(c["benchmark"], c["comparison"], c["vpaged"], c["baseline"]) for c in report["comparisons"]]
    assert got == expected
    printed = capsys.readouterr().out
    assert "3 engines, bursty" in printed and "copy-on-write of one page" in printed


def _script(tmp_path: Path, body: str, name: str = "bench_mapping.py") -> Path:
    folder = tmp_path / "benchmarks"
    folder.mkdir(exist_ok=True)
    (folder / "common.py").write_text("")
    (folder / name).write_text(textwrap.dedent(body))
    return folder


def test_loading_summary_rows_does_not_run_the_script(tmp_path):
    marker = tmp_path / "ran"
    folder = _script(
        tmp_path,
        f"""
        import pathlib
        pathlib.Path({str(marker)!r}).write_text("the benchmark ran")
        raise SystemExit("imported")
        LIMIT = 3

        def summary_rows(results):
            return [dict(benchmark="mapping", comparison=k, vpaged=v, baseline=1.0, baseline_name="b", unit="µs",
                         better="lower") for k, v in sorted(results.items())]
        """,
    )
    rows = suite.summary_rows("mapping", {"b": 2.0, "a": 5.0}, folder)
    assert [(r.comparison, r.vpaged, r.ratio) for r in rows] == [("a", 5.0, 5.0), ("b", 2.0, 2.0)]
    assert not marker.exists()


def test_an_edited_script_is_read_again(tmp_path):
    row = 'dict(benchmark="m", comparison="c", vpaged={v}, baseline=1.0, baseline_name="b", unit="s", better="lower")'
    folder = _script(tmp_path, f"def summary_rows(results):\n    return [{row.format(v=1.0)}]\n")
    assert suite.summary_rows("mapping", {}, folder)[0].vpaged == 1.0
    script = folder / "bench_mapping.py"
    script.write_text(f"def summary_rows(results):\n    return [{row.format(v=7.0)}]\n")
    st = script.stat()
    os.utime(script, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert suite.summary_rows("mapping", {}, folder)[0].vpaged == 7.0


@pytest.mark.parametrize(
    "body, message",
    [
        ("def other(results):\n    return []\n", r"defines no summary_rows\(results\)"),
        ("def summary_rows(results):\n    return [{'benchmark': 'mapping', 'vpaged': 1.0}]\n", "each row must be"),
        ("def summary_rows(results):\n    return ['row']\n", "each row must be"),
    ],
)
def test_a_script_without_usable_summary_rows_is_named(tmp_path, body, message):
    folder = _script(tmp_path, body)
    with pytest.raises(BenchmarkScriptError, match=message) as e:
        suite.summary_rows("mapping", {}, folder)
    assert "bench_mapping.py" in str(e.value)


def test_a_missing_script_or_unknown_benchmark_is_refused(tmp_path):
    folder = _script(tmp_path, "def summary_rows(results):\n    return []\n")
    with pytest.raises(BenchmarkScriptError, match="no benchmark script .*bench_sharing.py"):
        suite.summary_rows("sharing", {}, folder)
    with pytest.raises(InvalidArgumentError, match="unknown benchmark 'warp'"):
        suite.summary_rows("warp", {}, folder)


def test_bench_reports_a_script_without_summary_rows(tmp_path):
    folder = _script(
        tmp_path,
        """
        import json, os
        if __name__ == "__main__":
            open(os.path.join(os.environ["VPAGED_RESULTS_DIR"], "mapping_cpu.json"), "w").write(json.dumps({}))
        """,
    )
    out = tmp_path / "out"
    assert cli_main(["bench", "--quick", "--only", "mapping", "--benchmarks", str(folder), "--out", str(out)]) == 1
    report = json.loads((out / "bench.json").read_text())
    assert report["benchmarks"][0]["status"] == "no summary rows (see log)" and report["comparisons"] == []
    assert "defines no summary_rows(results)" in (out / "logs" / "mapping.log").read_text()


def test_numbers_without_a_benchmarks_folder_names_the_folder(tmp_path, monkeypatch, capsys):
    # As from an installed package: nothing beside it holds the scripts.
    monkeypatch.setattr(suite, "__file__", str(tmp_path / "site" / "vpaged" / "cli" / "suite.py"))
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / COMMITTED["mapping"][0], results)
    with pytest.raises(BenchmarkScriptError, match=f"no benchmark scripts at {tmp_path / 'site' / 'benchmarks'}"):
        numbers.render(results)
    assert numbers.main(["--check", "--results", str(results), "--out", str(tmp_path / "numbers.md")]) == 2
    assert f"no benchmark scripts at {tmp_path / 'site' / 'benchmarks'}" in capsys.readouterr().err


def test_a_fresh_sharing_run_gives_its_summary_rows(tmp_path):
    # bench_sharing.py's JSON kept its geometry record when GEOM became a KVGeometry (it called GEOM.items()
    # and failed before writing anything); its quick run takes seconds.
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_sharing.py"), "--quick"],
        cwd=BENCHMARKS,
        env={**os.environ, "VPAGED_RESULTS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "sharing_cpu.json").read_text())
    assert data["geometry"] == {"num_layers": "8", "num_kv_heads": "8", "head_dim": "64", "dtype": "torch.bfloat16"}
    rows = suite.summary_rows("sharing", data)
    assert [(r.comparison, r.vpaged, r.baseline) for r in rows] == _sharing(data)
