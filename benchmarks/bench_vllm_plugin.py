"""vLLM's CPU engine with and without vpaged under its KV cache: resident memory at start, under load and
after load, and throughput, in the same run (one fresh process per side).

    PYTHONPATH=. VLLM_CPU_OMP_THREADS_BIND=0-1 /work/venv-vllm/bin/python benchmarks/bench_vllm_plugin.py \
        --kv-gib 4 --requests 16 --max-tokens 64 [--model DIR] [--out results/vllm_plugin]

Each side runs this file with `side` in a child (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the engine, the
worker and the KV buffer are in the process measured). RSS is read from /proc/self/status every 50 ms from
before the engine starts until 3 s after the last request ends. Writes <out>.json and an <out>.svg plot of
RSS over time. Without --model it builds the tiny random Llama of tests/test_vllm_plugin.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def side(model: str, requests: int, max_tokens: int, idle_s: float) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_vllm_plugin import workload_prompts

    import vpaged.integrations.vllm as plugin

    plugin.register()  # where vLLM's entry point would call it
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            samples.append((time.monotonic() - t0, rss_bytes()))
            time.sleep(0.05)

    threading.Thread(target=sampler, daemon=True).start()
    from vllm import LLM, SamplingParams

    before = rss_bytes()
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    started = rss_bytes()
    t_start = time.monotonic() - t0
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in workload_prompts("random", requests)]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm the kernels
    t_load = time.monotonic() - t0
    tic = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - tic
    t_idle = time.monotonic() - t0
    peak_load = max(r for t, r in samples if t >= t_load) if samples else 0
    time.sleep(idle_s)
    stop.set()
    s = plugin.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    after_idle = [r for t, r in samples if t >= t_idle + 2.0]
    return {
        "plugin": s and s.__dict__,
        "rss_before_engine": before,
        "rss_after_start": started,
        "rss_peak_load": peak_load,
        "rss_2s_after_idle": min(after_idle) if after_idle else rss_bytes(),
        "tokens_per_s": tokens / elapsed,
        "marks": {"started": t_start, "load": t_load, "idle": t_idle},
        "samples": samples,
    }


def svg(results: dict, path: Path) -> None:
    w, h, pad = 800, 400, 40
    tmax = max(t for r in results.values() for t, _ in r["samples"])
    rmax = max(b for r in results.values() for _, b in r["samples"])
    colors = {"off": "#c0392b", "on": "#2471a3"}
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">'
    ]
    for name, r in results.items():
        pts = " ".join(
            f"{pad + t / tmax * (w - 2 * pad):.1f},{h - pad - b / rmax * (h - 2 * pad):.1f}" for t, b in r["samples"]
        )
        lines.append(f'<polyline fill="none" stroke="{colors[name]}" points="{pts}"/>')
        lines.append(
            f'<text x="{w - 160}" y="{20 + 16 * list(results).index(name)}" fill="{colors[name]}">plugin {name}</text>'
        )
    lines.append(f'<text x="{pad}" y="{pad - 10}">RSS (max {rmax / 2**30:.2f} GiB) over {tmax:.0f} s</text></svg>')
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-gib", type=int, default=4)  # vLLM reads an integer
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--model")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_plugin"))
    args = ap.parse_args()
    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="vpaged_tiny_llama_")
        subprocess.run([sys.executable, str(ROOT / "tests" / "test_vllm_plugin.py"), "model", model], check=True)
    results = {}
    for name in ("off", "on"):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib))
        env["VPAGED_VLLM"] = "1" if name == "on" else "0"
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, __file__, "--side", model, str(args.requests), str(args.max_tokens), str(args.idle_s)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(proc.stderr[-3000:])
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    off, on = results["off"], results["on"]
    kv = int(args.kv_gib * 2**30)
    off_kv = off["rss_after_start"] - off["rss_before_engine"]
    on_kv = on["rss_after_start"] - on["rss_before_engine"] - (off_kv - kv)  # the same model and engine, less KV
    summary = {
        "cpu": _cpu_name(),
        "kv_bytes": kv,
        "rss_after_start_gib": {n: r["rss_after_start"] / 2**30 for n, r in results.items()},
        "kv_rss_on_over_off": on_kv / kv,
        "rss_peak_load_gib": {n: r["rss_peak_load"] / 2**30 for n, r in results.items()},
        "rss_2s_after_idle_gib": {n: r["rss_2s_after_idle"] / 2**30 for n, r in results.items()},
        "tokens_per_s": {n: r["tokens_per_s"] for n, r in results.items()},
        "throughput_on_over_off": on["tokens_per_s"] / off["tokens_per_s"],
        "plugin_stats": on["plugin"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "runs": results}))
    svg(results, out.with_suffix(".svg"))
    print(json.dumps(summary, indent=1))


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--side":
        print(json.dumps(side(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))))
    else:
        main()
