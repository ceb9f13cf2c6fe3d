"""docs/numbers.md, generated from the benchmark results files (benchmarks/results/*.json, not archive/), so
no figure in the documentation is typed by hand.

One table per claim (a benchmark kind: mapping, sharing, decode, transformers, serving, elastic), each row a
comparison the benchmark measured beside its baseline, read by the `summary_rows(results)` function its script
exports (benchmarks/bench_*.py, the rows `vpaged bench` prints, loaded through `suite.summary_rows`), and naming
the machine, ISA and date it ran on: taken from the file, else from the machine tag of its name
(`..._epyc-zen3-avx2-2c.json`); a file without a date says "date unknown". Files no reader reads are listed
with their provenance, so each one is accounted for. Without a benchmarks/ folder beside the package (an
installed wheel) the page cannot be generated: BenchmarkScriptError names the folder looked in.

    python -m vpaged.cli.numbers            # rewrites docs/numbers.md
    python -m vpaged.cli.numbers --check    # exit 1 when docs/numbers.md differs from the results
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import BenchmarkScriptError
from . import suite

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "numbers.md"


def _vllm_plugin(d: dict) -> list[suite.Row]:
    """bench_vllm_plugin.py: vLLM's CPU engine with the plugin on against off, over bursts."""
    s = d["summary"]
    rss = s["rss_after_start_gib"]
    tps = s["tokens_per_s_median"]
    return [
        suite.Row("vllm", "RSS after start", min(rss["on"]), min(rss["off"]), "plugin off", "GiB", "lower"),
        suite.Row("vllm", "output tokens/s, median of bursts", tps["on"], tps["off"], "plugin off", "tok/s", "higher"),
    ]


def _vllm_elastic(d: dict) -> list[suite.Row]:
    """bench_vllm_elastic.py: two vLLM engines on one shared budget against a static split of it."""
    st, sh = d["static"], d["shared"]
    return [
        suite.Row("vllm", f"TTFT {q}, all requests", sh[key]["all"], st[key]["all"], "static split", "s", "lower")
        for q, key in (("p50", "ttft_p50_s"), ("p99", "ttft_p99_s"))
    ]


def _multi_round_rows(d: dict, topic: str, sections, label: str, baseline: str) -> list[suite.Row]:
    """Mean and p99 TTFT of the store arm against the own-cache arm of each multi-round section present;
    label is formatted with the section's `how`."""
    rows = []
    for section, how in sections:
        if section in d:
            s = d[section]["summary"]
            rows += [
                suite.Row(topic, f"{label.format(how=how)}, TTFT {q}", s[f"store_{q}_ttft_s"], s[f"own_{q}_ttft_s"],
                          baseline, "s", "lower")
                for q in ("mean", "p99")
            ]  # fmt: skip
    return rows


def _restart_rows(d: dict, topic: str, suffix: str = "") -> list[suite.Row]:
    """The warm restart's TTFT against its cold start, where the file has one."""
    if "warm_restart" not in d:
        return []
    w = d["warm_restart"]
    return [suite.Row(topic, f"TTFT of a {d['args']['warm']}-token prompt after a restart{suffix}",
                      w["warm"]["ttft_s"], w["cold"]["ttft_s"], "cold start", "s", "lower")]  # fmt: skip


def _prefix_store(d: dict) -> list[suite.Row]:
    """bench_prefix_store.py: two servers on one page store against each with its own prefix cache, and a
    server restarted on a directory store against its cold start."""
    # Files written before the users ran at once (no --stagger) hold the one-at-a-time run under "multi_round".
    at_once = "users at once" if "stagger" in d.get("args", {}) else "one request at a time"
    sections = (("multi_round", at_once), ("multi_round_serial", "one request at a time"))
    args = d.get("args", {})
    servers = args.get("servers", 2)  # files written before --servers ran two
    shape = f"{args.get('users', 8)} users x {args.get('rounds', 4)} rounds"
    if args.get("user_history"):  # files written before --user-history had none
        shape += f", {args['user_history']:,} tokens of history up front"
    label = "multi-round QA ({how}, " + f"{servers} servers, {shape})"
    rows = _multi_round_rows(d, "prefix store", sections, label, "own prefix caches")
    if "tier" in d:
        t = d["tier"]
        rows += [
            suite.Row("prefix store", "working set 4x the KV budget, second pass: prompt tokens that hit",
                      100 * t["store"]["hit_rate"], 100 * t["own"]["hit_rate"], "own prefix cache", "%", "higher"),
            suite.Row("prefix store", "working set 4x the KV budget, second pass: TTFT mean",
                      t["store"]["mean_ttft_s"], t["own"]["mean_ttft_s"], "own prefix cache", "s", "lower"),
        ]  # fmt: skip
    return rows + _restart_rows(d, "prefix store")


def _vllm_connector(d: dict) -> list[suite.Row]:
    """bench_vllm_connector.py: two vLLM instances on one page store (the connector) against each with vLLM's own
    prefix cache, and an instance restarted on a directory store against its cold start."""
    dt = d.get("dtype", "float32")
    sections = (("multi_round_serial", "one request at a time"), ("multi_round", "users at once"))
    label = "two instances, multi-round QA ({how}, " + dt + ")"
    rows = _multi_round_rows(d, "vllm connector", sections, label, "vLLM's own prefix caches")
    return rows + _restart_rows(d, "vllm connector", f" ({dt})")


def _vllm_pd(d: dict) -> list[suite.Row]:
    """bench_vllm_pd.py: a prefill/decode split over the page store against one instance on the same cores."""
    a, dt = d["args"], d.get("dtype", "float32")
    slo = f"TTFT <= {a['ttft_slo']} s and TPOT <= {a['tpot_slo']} s"
    best = (d["split"]["best_rate_90"], d["single"]["best_rate_90"])
    rows = [suite.Row("vllm connector", f"highest request rate with 90 % within {slo} ({dt})", *best,
                      "one instance", "req/s", "higher")]  # fmt: skip
    for split, single in zip(d["split"]["rates"], d["single"]["rates"]):
        rows.append(
            suite.Row("vllm connector", f"slowest TPOT at {split['rate']} req/s ({dt})", split["p99_tpot_s"],
                      single["p99_tpot_s"], "one instance", "s", "lower")
        )  # fmt: skip
    return rows


def _sampler(d: dict) -> list[suite.Row]:
    """bench_sampler.py: the serving sampler's step against the one-level draw (a prefix sum over the whole row),
    and in its top-p modes against the sorted cut (files from before that arm have no such rows)."""
    draws = [
        suite.Row("sampler", f"sample() of {c['rows']} x {c['vocab']} fp32 logits, {c['mode']}", c["vpaged_ms"],
                  c["one_level_ms"], "one-level draw", "ms", "lower")
        for c in d["cells"]
        if c["mode"] != "greedy"  # no draw: both arms run the same code
    ]  # fmt: skip
    cuts = [
        suite.Row("sampler", f"sample() of {c['rows']} x {c['vocab']} fp32 logits, {c['mode']}", c["vpaged_ms"],
                  c["sorted_top_p_ms"], "sorted top-p cut", "ms", "lower")
        for c in d["cells"]
        if "sorted_top_p_ms" in c
    ]  # fmt: skip
    return draws + cuts


def _chunk_attention(d: dict) -> list[suite.Row]:
    """bench_chunk_attention.py: a prefill chunk after cached tokens split in two unmasked calls against one masked
    call, per layer and through the engine (SmolLM2's first token)."""
    rows = [
        suite.Row("chunk attention", f"one layer, {c['tokens']:,} tokens after {c['start']:,} cached, {c['dtype']}",
                  c["split_ms"], c["masked_ms"], "one masked call", "ms", "lower")
        for c in d["kernel"]
    ]  # fmt: skip
    rows += [
        suite.Row("chunk attention", f"SmolLM2-135M fp32 first token, {c['case']}", c["split_s"], c["masked_s"],
                  "one masked call", "s", "lower")
        for c in d.get("engine", [])
    ]  # fmt: skip
    return rows


def _store_publish(d: dict) -> list[suite.Row]:
    """bench_store_publish.py: PageStore.publish_many of a batch against publish of each page, per capacity."""
    base = {c["capacity"]: c["ms_per_page"] for c in d["cells"] if c["arm"] == "publish each page"}
    return [
        suite.Row("prefix store", f"publishing a page, {c['arm']}, store of {c['capacity']:,} pages", c["ms_per_page"],
                  base[c["capacity"]], "publish each page", "ms", "lower")
        for c in d["cells"]
        if c["arm"] != "publish each page"
    ]  # fmt: skip


def _script_reader(bench: str) -> Callable[[dict], list[suite.Row]]:
    """The rows of a suite benchmark's results, read by its script's summary_rows (found when a file is read,
    not at import)."""
    return functools.partial(suite.summary_rows, bench)


# The file-name prefix of a results file -> the claim it backs and how its rows are read.
CLAIMS: dict[str, tuple[str, Callable[[dict], list[suite.Row]]]] = {
    "mapping": ("Mapping a page: vpaged against the bare system calls", _script_reader("mapping")),
    "sharing": ("Sharing: fork, copy-on-write and swap against plain copies", _script_reader("sharing")),
    "decode": ("Decode attention: vpaged against the copy floor and a block table", _script_reader("decode")),
    "hf": ("transformers: VPagedCache against DynamicCache", _script_reader("transformers")),
    "serve": ("Serving throughput: the engine against generate_batch and vLLM", _script_reader("serving")),
    "elastic": ("A shared budget against a static split", _script_reader("elastic")),
    "vllm-plugin": ("The vLLM plugin: vLLM's CPU engine with the plugin on against off", _vllm_plugin),
    "vllm-elastic": ("Two vLLM engines on one shared budget against a static split", _vllm_elastic),
    "prefix-store": ("A prefix store shared by server processes and restarts", _prefix_store),
    "vllm-connector": ("vLLM instances on one page store through vpaged's KV connector", _vllm_connector),
    "vllm-pd": ("vLLM prefill/decode split over the page store against one instance", _vllm_pd),
    "sampler": ("The serving sampler's draw against a prefix sum over the whole vocabulary", _sampler),
    "store-publish": ("Publishing pages to a page store: in batches against one by one", _store_publish),
    "chunk-attention": ("A prefill chunk after cached tokens: split against masked attention", _chunk_attention),
}

_ISAS = ("amx", "avx512bf16", "avx512", "avx2", "neon", "sve")
# The names a machine tag's parts are read as when a run recorded no ISA. Not "amx": in a tag it names the CPU (e.g.
# xeon-amx-2c), and the runs on such a box before vpaged had an amx path ran the avx512bf16 one.
_TAG_ISAS = tuple(isa for isa in _ISAS if isa != "amx")

# Results files kept for the record but no longer quoted as their claim's figures, with why (the analysis is in
# benchmarks/NOTES.md). Their rows are listed apart, under the reason, never in a claim's table.
SUPERSEDED: dict[str, str] = {
    "chunk-attention_epyc-zen3-avx2-2c.json": (
        "the split before a K/V head's query heads shared the cached prefix's call (the prefix's K/V copied per "
        "query head); measured again with them sharing it in chunk-attention-grouped_epyc-zen3-avx2-2c.json"
    ),
    "prefix-store_serial-4-servers-before-batched_epyc-zen3-avx2-2c.json": (
        "the library of 6958f34, before PageStore.publish_many: the control run of "
        "prefix-store_serial-4-servers-batched_epyc-zen3-avx2-2c.json (the ratio is level between the two)"
    ),
    "prefix-store_multi-round-warm_epyc-zen4-avx512bf16-2c.json": (
        "hits copied each page then (987 MB for 21,428 tokens); they map the store's pages now, measured again with "
        "the users at once and a tier section in prefix-store_mapped-concurrent-tier_epyc-zen4-avx512bf16-2c.json"
    ),
    "elastic_bursty-1.5mib_epyc-avx2-2c.json": (
        "measured a loaded CPU (load 16-19), not memory: on a quiet box the same command preempts nothing in "
        "either arm (elastic_bursty-1.5mib-quiet_epyc-avx2-2c.json)"
    ),
}


@dataclass(frozen=True)
class Provenance:
    machine: str
    isa: str
    date: str
    load: str  # the 1-minute load average when the run began: a busy box's figures are not a quiet one's


def _is_scalar(v) -> bool:
    return isinstance(v, str | int | float) and not isinstance(v, bool)


def _is_numbers(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, int | float) for x in v)


def _find(d, keys: tuple[str, ...], accept=_is_scalar, depth: int = 0):
    """The first value `accept` takes under one of `keys`, searched breadth-first a few levels into the file
    (a scalar by default)."""
    if depth > 3 or not isinstance(d, dict):
        return None
    for k in keys:
        if k in d and accept(d[k]):
            return d[k]
    for v in d.values():
        found = _find(v, keys, accept, depth + 1)
        if found is not None:
            return found
    return None


def machine_tag(path: Path) -> str:
    """The machine tag of a results file's name: its last `_`-separated part (`epyc-zen3-avx2-2c`)."""
    return path.stem.rsplit("_", 1)[-1]


def provenance(path: Path, data: dict) -> Provenance:
    tag = machine_tag(path)
    parts = tag.split("-")
    cpu = _find(data, ("cpu", "cpu_model"))
    cores = _find(data, ("cores",))
    machine = f"{cpu}, {cores} cores" if cpu and cores else (str(cpu) if cpu else None)
    machine = f"{machine} ({tag})" if machine else tag
    isa = _find(data, ("vpaged_isa", "isa"))
    if not isa or str(isa).startswith("unknown"):  # a run that could not ask the extension records "unknown (...)"
        isa = next((p for p in parts if p in _TAG_ISAS), None) or "ISA unknown"
    date = _find(data, ("date", "timestamp"))
    date = str(date)[:10] if date else "date unknown"
    load = _find(data, ("load_average_1min", "load_1min"))
    if load is None:  # bench_elastic.py records os.getloadavg(): (1, 5, 15 minutes)
        averages = _find(data, ("load_average",), _is_numbers)
        load = averages[0] if averages else None
    load = f"{float(load):.1f}" if isinstance(load, int | float) else "load unknown"
    return Provenance(machine, str(isa), date, load)


def results_files(results: Path = RESULTS) -> list[Path]:
    return sorted(results.glob("*.json"))


def _fmt(x: float) -> str:
    if x != x:  # nan
        return "–"
    if float(x).is_integer() and abs(x) < 1e15:  # counts: 31 requests, not 31.0
        return f"{int(x):,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _rows(path: Path, data: dict) -> tuple[str | None, list[suite.Row]]:
    prefix = path.name.split("_", 1)[0]
    claim = CLAIMS.get(prefix)
    if claim is None:
        return None, []
    try:
        return prefix, claim[1](data)
    except BenchmarkScriptError:
        raise  # no script, or one whose summary_rows is missing or gives no rows: not a file of another shape
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError):
        return None, []  # a file of another shape than the reader reads: listed with the others


def render(results: Path = RESULTS) -> str:
    tables: dict[str, list[str]] = {key: [] for key in CLAIMS}
    others: list[str] = []
    superseded: list[str] = []
    for path in results_files(results):
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {"rows": data}
        prov = provenance(path, data)
        key, rows = _rows(path, data)
        ref = f"[{path.name}](../benchmarks/results/{path.name})"
        if not rows:
            others.append(f"| {ref} | {prov.machine} | {prov.isa} | {prov.date} | {prov.load} |")
            continue
        for r in rows:
            line = (
                f"| {r.comparison} | {_fmt(r.vpaged)} {r.unit} | {_fmt(r.baseline)} {r.unit} ({r.baseline_name}) "
                f"| {_fmt(r.ratio)}x ({r.better} is better) | {prov.machine} | {prov.isa} | {prov.date} | {prov.load} "
                f"| {ref} |"
            )
            if path.name in SUPERSEDED:
                superseded.append(f"{line} {SUPERSEDED[path.name]} |")
            else:
                tables[key].append(line)
    out = [
        "# Numbers",
        "",
        "Generated by `python -m vpaged.cli.numbers` from `benchmarks/results/*.json`; do not edit by hand",
        "(`tests/project/test_docs_numbers.py` fails when this page and the results files disagree). Each row",
        "names the machine, ISA, date and 1-minute load average of the run: the file's own fields where it has",
        "them, else its name's machine tag. A figure measured under load (a busy box) need not reproduce on a",
        "quiet one.",
        "The command that wrote each kind of file, its settings and the analysis: `benchmarks/NOTES.md`.",
        "",
    ]
    for key, (title, _) in CLAIMS.items():
        if not tables[key]:
            continue
        out += [
            f"## {title}",
            "",
            "| comparison | vpaged | baseline | vpaged / baseline | machine | ISA | date | load | results |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *tables[key],
            "",
        ]
    if superseded:
        out += [
            "## Superseded results",
            "",
            "Kept for the record, no longer quoted as their claim's figures:",
            "",
            "| comparison | vpaged | baseline | vpaged / baseline | machine | ISA | date | load | results | why |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *superseded,
            "",
        ]
    if others:
        out += [
            "## Other results files",
            "",
            "Results that no summary table reads (their own benchmark's report has the figures):",
            "",
            "| results | machine | ISA | date | load |",
            "| --- | --- | --- | --- | --- |",
            *others,
            "",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vpaged.cli.numbers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the results")
    parser.add_argument("--results", type=Path, default=RESULTS, help="results folder (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        text = render(args.results)
    except BenchmarkScriptError as e:
        print(f"python -m vpaged.cli.numbers: {e}", file=sys.stderr)
        return 2
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is not what the results generate: run python -m vpaged.cli.numbers", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
