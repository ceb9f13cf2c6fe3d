"""vLLM's CPU engine with and without vpaged under its KV cache, in one run: throughput, the plugin's own
per-step cost, and resident memory over time while requests come in bursts with idle gaps between them.

    PYTHONPATH=. VLLM_CPU_OMP_THREADS_BIND=0-1 /work/venv-vllm/bin/python benchmarks/bench_vllm_plugin.py \
        --kv-gib 4 --rounds 2 --bursts 3 --requests 16 --max-tokens 64 [--model DIR] [--out results/vllm_plugin]

Each side (plugin off, on) runs this file with `--side` in a fresh child, the sides alternated for --rounds
rounds (off, on, off, on, ...): a loaded shared box drifts, and alternating spreads the drift over both.
VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine, the worker and the KV buffer in the process measured;
its VmRSS (/proc/self/status) and vpaged's mapped KV bytes are sampled every 100 ms. A side runs --bursts
bursts of --requests requests (fresh random prompts each), each followed by --idle-s seconds of idle;
throughput is the median over its bursts and the figure is the median over rounds. "Fall" is the time from
a burst's end until RSS is back within 10 % of that burst's rise (plus 4 MiB of allocator noise). Writes
<out>.json and <out>.svg. Without --model it builds the tiny random Llama of tests/integrations/test_vllm_plugin.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_S = 0.1


def rss_bytes(pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def side(model: str, requests: int, max_tokens: int, idle_s: float, bursts: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_vllm_plugin import workload_prompts

    import vpaged.integrations.vllm as plugin
    from vpaged.integrations.vllm.patches import STATE

    plugin.register()  # where vLLM's entry point would call it
    samples: list[tuple[float, int, int]] = []  # (s, RSS bytes, vpaged mapped KV bytes)
    t0 = time.monotonic()
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            kv = STATE.backing.mapped_bytes() if STATE.backing is not None else 0
            samples.append((time.monotonic() - t0, rss_bytes(), kv))
            time.sleep(SAMPLE_S)

    threading.Thread(target=sampler, daemon=True).start()
    from vllm import LLM, SamplingParams

    before = rss_bytes()
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    started = rss_bytes()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in workload_prompts("random", 2)], SamplingParams(max_tokens=4))
    time.sleep(idle_s)  # the warm-up's pages go back before the first burst
    STATE.hook_seconds = STATE.step_seconds = 0.0
    marks, rates = [], []
    for k in range(bursts):
        prompts = [{"prompt_token_ids": p} for p in workload_prompts("random", requests, seed=100 + k)]
        start = time.monotonic() - t0
        tic = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - tic))
        marks.append((start, time.monotonic() - t0))
        time.sleep(idle_s)
    stop.set()
    s = plugin.stats()
    return {
        "plugin": s and s.__dict__,
        "hook_share_of_step": STATE.hook_seconds / STATE.step_seconds if STATE.step_seconds else None,
        "rss_before_engine": before,
        "rss_after_start": started,
        "tokens_per_s_bursts": rates,
        "tokens_per_s": statistics.median(rates),
        "bursts": marks,
        "samples": samples,
    }


def falls(run: dict, idle_s: float) -> list[dict]:
    """Per burst: RSS before it, its peak, the level it settles at once idle, and two fall times from the
    burst's end: until RSS is within 10 % of its rise above that settled level (plus 4 MiB of allocator
    noise), and until vpaged's mapped KV is back to where it was before the burst. The settled level may sit
    above the level before: vLLM's first bursts grow buffers outside the KV (as much with the plugin off)."""
    out = []
    samples = run["samples"]
    for start, end in run["bursts"]:
        pre = [x for x in samples if start - 1.0 <= x[0] < start] or samples[:1]
        during = [x for x in samples if start <= x[0] <= end + 0.3] or pre
        settled_at = [r for t, r, _ in samples if end + idle_s - 0.6 <= t <= end + idle_s] or [pre[-1][1]]
        base, peak, settled = min(r for _, r, _ in pre), max(r for _, r, _ in during), min(settled_at)
        kv_before = min(kv for _, _, kv in pre)
        near = settled + 0.1 * max(0, peak - settled) + 4 * 2**20
        fall = next((t - end for t, r, _ in samples if t >= end and r <= near), None)
        kv_fall = next((t - end for t, _, kv in samples if t >= end and kv <= kv_before), None)
        out.append(
            {
                "rss_before": base,
                "rss_peak": peak,
                "rss_settled": settled,
                "kv_peak": max(kv for _, _, kv in during),
                "fall_s": fall,
                "kv_fall_s": kv_fall,
            }
        )
    return out


def summarize(rounds: list[dict], settings: dict) -> dict:
    for r in rounds:
        for run in r.values():
            run["falls"] = falls(run, settings["idle_s"])
    ratios = [r["on"]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in rounds]
    on_falls = [f for r in rounds for f in r["on"]["falls"]]
    mib = 2**20
    return {
        "cpu": machine()["cpu"],
        "settings": settings,
        "tokens_per_s_median": {n: statistics.median(r[n]["tokens_per_s"] for r in rounds) for n in ("off", "on")},
        "throughput_on_over_off_per_round": ratios,
        "throughput_on_over_off_median": statistics.median(ratios),
        "hook_share_of_step": [r["on"]["hook_share_of_step"] for r in rounds],
        "rss_after_start_gib": {n: [r[n]["rss_after_start"] / 2**30 for r in rounds] for n in ("off", "on")},
        "rss_rise_mib": {
            n: [(f["rss_peak"] - f["rss_before"]) / mib for r in rounds for f in r[n]["falls"]] for n in ("off", "on")
        },
        "rss_settled_over_before_mib": {
            n: [(f["rss_settled"] - f["rss_before"]) / mib for r in rounds for f in r[n]["falls"]]
            for n in ("off", "on")
        },
        "kv_peak_mib_on": [f["kv_peak"] / mib for f in on_falls],
        "fall_s_on": [f["fall_s"] for f in on_falls],
        "kv_fall_s_on": [f["kv_fall_s"] for f in on_falls],
        "fall_within_2s_on": all(f["fall_s"] is not None and f["fall_s"] <= 2.0 for f in on_falls),
        "kv_fall_within_2s_on": all(f["kv_fall_s"] is not None and f["kv_fall_s"] <= 2.0 for f in on_falls),
        "plugin_stats": rounds[-1]["on"]["plugin"],
    }


def svg(runs: dict, path: Path) -> None:
    """Two panels: RSS of the last round's sides (GiB), and the plugin side's RSS above its level after
    start with the KV bytes it has mapped (MiB); bursts shaded."""
    w, h, pad = 820, 520, 50
    on, off = runs["on"], runs["off"]
    tmax = max(t for r in (on, off) for t, _, _ in r["samples"])
    x = lambda t: pad + t / tmax * (w - 2 * pad)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">']

    def panel(top, height, series, ymax, label):
        y = lambda v: top + height - v / ymax * height  # noqa: E731
        for s, e in on["bursts"]:
            out.append(f'<rect x="{x(s):.1f}" y="{top}" width="{x(e) - x(s):.1f}" height="{height}" fill="#eee"/>')
        out.append(f'<text x="{pad}" y="{top - 6}">{label} (max {ymax:.2f})</text>')
        for i, (name, color, pts) in enumerate(series):
            line = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in pts)
            out.append(f'<polyline fill="none" stroke="{color}" points="{line}"/>')
            out.append(f'<text x="{w - 230}" y="{top + 14 + 14 * i}" fill="{color}">{name}</text>')

    gib = [
        (n, c, [(t, r / 2**30) for t, r, _ in run["samples"]])
        for n, c, run in (("RSS, plugin off", "#c0392b", off), ("RSS, plugin on", "#2471a3", on))
    ]
    panel(40, 180, gib, max(v for _, _, p in gib for _, v in p), "RSS, GiB")
    base = on["rss_after_start"]
    mib = [
        ("RSS above start, plugin on", "#2471a3", [(t, max(0, r - base) / 2**20) for t, r, _ in on["samples"]]),
        ("vpaged KV mapped", "#27ae60", [(t, kv / 2**20) for t, _, kv in on["samples"]]),
    ]
    panel(280, 200, mib, max(1.0, max(v for _, _, p in mib for _, v in p)), "MiB, plugin on (its bursts shaded)")
    out.append(f'<text x="{pad}" y="{h - 10}">seconds since the process started (0 .. {tmax:.0f})</text></svg>')
    path.write_text("\n".join(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-gib", type=int, default=4)  # vLLM reads an integer
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--model")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_plugin"))
    ap.add_argument("--summarize", help="recompute the summary and the plot of an earlier <out>.json")
    args = ap.parse_args()
    if args.summarize:
        rounds = json.loads(Path(args.summarize).read_text())["rounds"]
        settings = json.loads(Path(args.summarize).read_text())["summary"]["settings"]
        _write(Path(args.out), summarize(rounds, settings), rounds)
        return
    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="vpaged_tiny_llama_")
        subprocess.run(
            [sys.executable, str(ROOT / "tests" / "integrations" / "test_vllm_plugin.py"), "model", model], check=True
        )
    rounds = []
    for _ in range(args.rounds):
        runs = {}
        for name in ("off", "on"):
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib))
            env["VPAGED_VLLM"] = "1" if name == "on" else "0"
            env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [sys.executable, __file__, "--side", model]
            cmd += [str(v) for v in (args.requests, args.max_tokens, args.idle_s, args.bursts)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(proc.stderr[-3000:])
            runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        rounds.append(runs)
    settings = vars(args) | {"model": "tiny random Llama" if args.model is None else args.model}
    summary = summarize(rounds, settings)
    _write(Path(args.out), summary, rounds)


def _write(out: Path, summary: dict, rounds: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "rounds": rounds}))
    svg(rounds[-1], out.with_suffix(".svg"))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--side":
        a = sys.argv[2:]
        print(json.dumps(side(a[0], int(a[1]), int(a[2]), float(a[3]), int(a[4]))))
    else:
        main()
