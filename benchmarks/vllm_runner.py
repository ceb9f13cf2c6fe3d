"""The vLLM side of bench_serve.py and bench_decode.py: run by an interpreter that has vLLM's CPU build
(`--vllm-python PATH`), in a process of its own, so vLLM never has to be importable next to vpaged.

    PYTHON benchmarks/vllm_runner.py probe            # is vLLM (its CPU build) importable? its version
    PYTHON benchmarks/vllm_runner.py serve JOB.json   # serve the job's prompts on vllm.LLMEngine
    PYTHON benchmarks/vllm_runner.py decode JOB.json  # time vLLM's CPU paged-attention decode op

Protocol: the job is a JSON file written by the caller; the runner prints exactly one line starting with
RESULT_MARKER followed by a JSON object (vLLM's own logging goes to stderr and any other stdout is ignored).
On failure the object has "error" (a one-line reason) and the exit status is 1.

serve job: model_dir (a transformers checkpoint: config.json + safetensors), prompts (lists of token ids),
arrivals (seconds after the start, one per prompt), max_tokens, max_model_len, max_num_seqs,
max_num_batched_tokens, dtype ("float32"), seed. Every request is greedy (temperature 0), ignores EOS and
asks for exactly max_tokens tokens. The requests are added when they arrive and the engine is stepped while
work is pending, as vpaged.serve.bench.run_workload drives vpaged's engine, and the same clock is read: a
request's first token is the step after which its output first holds a token, TTFT is that minus its arrival,
TPOT is (finish - first) / (tokens - 1). Result: seconds, output_tokens, outputs (token ids per prompt, in
the prompts' order), ttft / tpot lists, finish_reasons, vllm_version, load_seconds.

With "api": "generate" the job runs as vLLM's users run it offline: vllm.LLM(...) and one LLM.generate call over
every prompt (all must arrive at 0), timed around that call; no per-request TTFT / TPOT then.

The thread count and the KV space are vLLM's environment variables (VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_KVCACHE_SPACE), set by the caller.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

RESULT_MARKER = "VPAGED_VLLM_RESULT "


def emit(obj: dict) -> None:
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(obj), flush=True)


def probe() -> dict:
    import vllm

    info = {"vllm_version": getattr(vllm, "__version__", "?"), "python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001
        info["torch"] = f"unimportable: {e}"
    try:
        from vllm.platforms import current_platform

        info["platform"] = type(current_platform).__name__
        info["is_cpu"] = bool(current_platform.is_cpu())
    except Exception as e:  # noqa: BLE001
        info["platform"] = f"unknown: {e.__class__.__name__}: {e}"
        info["is_cpu"] = False
    try:  # the head sizes its CPU attention backend takes (a model outside them fails at its first step)
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        info["head_sizes"] = list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001
        pass
    return info


def _make_engine(job: dict):
    from vllm import EngineArgs, LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(**_engine_kwargs(job)))


def _engine_kwargs(job: dict) -> dict:
    return dict(
        model=job["model_dir"],
        skip_tokenizer_init=True,
        dtype=job.get("dtype", "float32"),
        max_model_len=int(job["max_model_len"]),
        max_num_seqs=int(job["max_num_seqs"]),
        max_num_batched_tokens=int(job["max_num_batched_tokens"]),
        seed=int(job.get("seed", 0)),
        enforce_eager=bool(job.get("enforce_eager", False)),
        **({"block_size": int(job["block_size"])} if job.get("block_size") else {}),
    )


def _greedy_params(job: dict):
    """The job's sampling: greedy, EOS ignored, exactly max_tokens tokens, no detokenizing."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=int(job["max_tokens"]),
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        seed=int(job.get("seed", 0)),
    )


def generate(job: dict) -> dict:
    """The job through vllm.LLM.generate: one call over every prompt, as an offline user makes it."""
    import vllm
    from vllm import LLM

    if any(a for a in job.get("arrivals") or []):
        raise ValueError('"api": "generate" serves prompts that all arrive at once (arrivals 0)')
    t_load = time.perf_counter()
    llm = LLM(**_engine_kwargs(job))
    load_seconds = time.perf_counter() - t_load
    prompts = job["prompts"]
    params = _greedy_params(job)
    llm.generate([{"prompt_token_ids": list(prompts[0][:16])}], params, use_tqdm=False)  # warm, as serve() does
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [[int(x) for x in o.outputs[0].token_ids] for o in outs]
    reasons: dict[str, int] = {}
    for o in outs:
        r = str(o.outputs[0].finish_reason)
        reasons[r] = reasons.get(r, 0) + 1
    return {
        "vllm_version": getattr(vllm, "__version__", "?"),
        "api": "generate",
        "load_seconds": load_seconds,
        "seconds": seconds,
        "steps": None,
        "requests": len(prompts),
        "output_tokens": sum(map(len, tokens)),
        "outputs": tokens,
        "ttft": [],
        "tpot": [],
        "finish_reasons": reasons,
    }


def serve(job: dict) -> dict:
    if job.get("api") == "generate":
        return generate(job)
    t_load = time.perf_counter()
    engine = _make_engine(job)
    load_seconds = time.perf_counter() - t_load
    prompts = job["prompts"]
    arrivals = job.get("arrivals") or [0.0] * len(prompts)
    params = _greedy_params(job)
    warm = int(job.get("warmup_requests", 1))
    for w in range(warm):  # one short request first: compiles / allocates what the first step would
        engine.add_request(f"warm-{w}", {"prompt_token_ids": list(prompts[w % len(prompts)][:16])}, params)
    while engine.has_unfinished_requests():
        engine.step()

    n = len(prompts)
    order = sorted(range(n), key=lambda i: arrivals[i])
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    reasons: dict[str, int] = {}
    steps = 0
    t0 = time.perf_counter()
    nxt = 0
    while nxt < n or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < n and arrivals[order[nxt]] <= now:
            i = order[nxt]
            engine.add_request(f"bench-{i}", {"prompt_token_ids": list(prompts[i])}, params)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[order[nxt]] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        steps += 1
        t = time.perf_counter() - t0
        for out in outs:
            rid = str(out.request_id)
            if not rid.startswith("bench-"):
                continue
            i = int(rid.split("-", 1)[1])
            comp = out.outputs[0] if out.outputs else None
            if i not in first and comp is not None and len(comp.token_ids) > 0:
                first[i] = t
            if out.finished:
                finish[i] = t
                tokens[i] = [int(x) for x in comp.token_ids] if comp is not None else []
                r = str(comp.finish_reason) if comp is not None else "none"
                reasons[r] = reasons.get(r, 0) + 1
    seconds = time.perf_counter() - t0
    import vllm

    ttft = [first[i] - arrivals[i] for i in sorted(first)]
    tpot = [(finish[i] - first[i]) / (len(tokens[i]) - 1) for i in sorted(tokens) if len(tokens[i]) > 1 and i in first]
    return {
        "vllm_version": getattr(vllm, "__version__", "?"),
        "load_seconds": load_seconds,
        "seconds": seconds,
        "steps": steps,
        "requests": n,
        "output_tokens": sum(len(v) for v in tokens.values()),
        "outputs": [tokens.get(i, []) for i in range(n)],
        "ttft": ttft,
        "tpot": tpot,
        "finish_reasons": reasons,
    }


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("probe", "serve", "decode"):
        print(__doc__, file=sys.stderr)
        return 2
    cmd = argv[0]
    try:
        if cmd == "probe":
            result = probe()
        else:
            with open(argv[1]) as f:
                job = json.load(f)
            if cmd == "serve":
                result = serve(job)
            else:
                from vllm_decode import decode  # beside this file

                result = decode(job)
    except Exception as e:  # noqa: BLE001 - every failure becomes the protocol's error line
        traceback.print_exc(file=sys.stderr)
        emit({"error": f"{e.__class__.__name__}: {e}".splitlines()[0][:500]})
        return 1
    emit(result)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main(sys.argv[1:]))
