"""Real clients against `vpaged serve` on SmolLM2-135M-Instruct (benchmarks/real_model.py): lm-eval, LangChain, agents.

1. lm-eval, a local `multiple_choice` task (a JSONL and a task YAML written to a temporary folder, read through
   `--include_path`; nothing is downloaded), run with the `hf` backend (transformers in this process's venv)
   and with `local-completions` against the server: accuracy and every choice's loglikelihood compared (from
   `--log_samples`); and a local `generate_until` task run both ways, the greedy outputs compared.
2. LangChain (langchain-openai's ChatOpenAI on the server): `with_structured_output` of a Pydantic schema with
   `method="json_schema"` and `method="function_calling"`, and `bind_tools(..., tool_choice="required")`, each
   on `--prompts` prompts: how many outputs parse and validate.
3. Agent frameworks with tools under `tool_choice="auto"`: LangGraph's prebuilt ReAct agent and LangChain's
   `create_agent`, openai-agents' `Runner` over its chat-completions model, pydantic-ai's `Agent`, each on
   `--agent-prompts` prompts with two tools, through a recording proxy (eval_agents.py): per framework its
   requests, each one's prompt tokens with and without its tools (the server's /tokenize), the replies that
   parsed, the tool calls in them, runs that finished or hit the framework's turn limit, and client exceptions
   with their message. What a 135M model chooses to call is its own affair; every reply must parse.

The server's log (warnings and errors) is kept in the results: `server_log` (its lines at WARNING or above,
and whether any holds a traceback).

The clients live in their own venv (they pull packages vpaged does not need); the server runs vpaged from this
checkout in the venv given by --server-python:

  python3 -m venv /work/venv-clients && /work/venv-clients/bin/pip install torch==2.13.0 \
      && /work/venv-clients/bin/pip install lm-eval==0.4.13 langchain-openai openai transformers accelerate
  /work/venv-clients/bin/pip install langgraph langchain openai-agents "pydantic-ai-slim[openai]"  # part 3
  /work/venv-clients/bin/python benchmarks/eval_clients.py --server-python .venv/bin/python

Writes benchmarks/results/<--output> with the CPU named.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model  # noqa: E402
from common import machine, print_table, write_json  # noqa: E402
from eval_agents import AGENT_HEADERS, agent_rows, run_agents  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAME = "smollm2"
LL_TOLERANCE = 1e-3

MC_TASK = """task: vpaged_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """task: vpaged_local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: {max_gen}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""

COLORS = {"the sky on a clear day": "blue", "fresh grass": "green", "snow": "white", "coal": "black"}
CAPITALS = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Spain": "Madrid", "Germany": "Berlin"}


def mc_docs(n: int, rng: random.Random) -> list[dict]:
    """n questions with 4 choices each: sums, capitals, colours (fresh numbers from rng each run)."""
    docs = []
    while len(docs) < n:
        kind = len(docs) % 3
        if kind == 0:
            a, b = rng.randint(2, 40), rng.randint(2, 40)
            right = a + b
            wrong = rng.sample([x for x in range(right - 9, right + 10) if x != right and x > 0], 3)
            q, options = f"Question: What is {a} plus {b}?\nAnswer:", [right, *wrong]
        elif kind == 1:
            country = rng.choice(sorted(CAPITALS))
            others = rng.sample([c for k, c in CAPITALS.items() if k != country], 3)
            q, options = f"Question: What is the capital of {country}?\nAnswer:", [CAPITALS[country], *others]
        else:
            thing = rng.choice(sorted(COLORS))
            others = [c for k, c in COLORS.items() if k != thing]
            q, options = f"Question: What colour is {thing}?\nAnswer:", [COLORS[thing], *others]
        choices = [f" {o}" for o in options]
        rng.shuffle(choices)
        docs.append({"question": q, "choices": choices, "answer": choices.index(f" {options[0]}")})
    return docs


def gen_docs(n: int, rng: random.Random) -> list[dict]:
    subjects = ["A cat", "The river", "My friend", "The old house", "A small bird", "The teacher", "Every morning"]
    verbs = ["likes to", "is going to", "wants to", "decided to", "used to"]
    docs = []
    for _ in range(n):
        docs.append({"prompt": f"{rng.choice(subjects)} {rng.choice(verbs)}", "target": ""})
    return docs


def write_tasks(folder: Path, args, rng: random.Random) -> None:
    for name, docs, template in (
        ("mc", mc_docs(args.mc_samples, rng), MC_TASK),
        ("gen", gen_docs(args.gen_samples, rng), GEN_TASK),
    ):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(template.format(data=data, max_gen=args.max_gen_tokens))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, model: Path, port: int, log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [args.server_python, "-m", "vpaged.cli.main", "serve", str(model), "--port", str(port)]
    cmd += ["--served-model-name", NAME, "--threads", str(args.threads), "--kv-budget-mib", "256"]
    cmd += ["--max-num-seqs", "8", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("the server did not become ready in 600 s")


def server_log(text: str) -> dict:
    """The server's lines at WARNING or above (it runs with --log-level warning, so that is every line but
    uvicorn's start and stop) and how many tracebacks it printed."""
    lines = [line for line in text.splitlines() if line.strip()]
    noise = (
        "Loading weights",
        "Started server process",
        "Waiting for application",
        "Application startup",
        "Uvicorn running",
    )
    kept = [line for line in lines if not any(n in line for n in noise)]
    return {"lines": kept[:50], "lines_total": len(kept), "tracebacks": sum("Traceback" in line for line in lines)}


def run_lm_eval(args, folder: Path, model_kind: str, model_args: str, out: Path) -> None:
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model_kind, "--model_args", model_args]
    cmd += ["--tasks", "vpaged_local_mc,vpaged_local_gen", "--include_path", str(folder)]
    cmd += ["--output_path", str(out), "--log_samples", "--batch_size", "1", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env)


def samples(out: Path, task: str) -> dict[int, dict]:
    files = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    if len(files) != 1:
        raise SystemExit(f"expected one samples file of {task} under {out}, found {files}")
    rows = [json.loads(line) for line in Path(files[0]).read_text().splitlines() if line.strip()]
    return {r["doc_id"]: r for r in rows}


def compare_lm_eval(hf_out: Path, api_out: Path) -> dict:
    hf_mc, api_mc = samples(hf_out, "vpaged_local_mc"), samples(api_out, "vpaged_local_mc")
    assert hf_mc.keys() == api_mc.keys()
    diffs = []
    for doc in hf_mc:
        for (hf_ll, _), (api_ll, _) in zip(hf_mc[doc]["filtered_resps"], api_mc[doc]["filtered_resps"]):
            diffs.append(abs(float(hf_ll) - float(api_ll)))
    acc_hf = sum(r["acc"] for r in hf_mc.values()) / len(hf_mc)
    acc_api = sum(r["acc"] for r in api_mc.values()) / len(api_mc)
    hf_gen, api_gen = samples(hf_out, "vpaged_local_gen"), samples(api_out, "vpaged_local_gen")
    differing = [
        {"doc": d, "hf": hf_gen[d]["filtered_resps"], "server": api_gen[d]["filtered_resps"]}
        for d in hf_gen
        if hf_gen[d]["filtered_resps"] != api_gen[d]["filtered_resps"]
    ]
    return {
        "mc_docs": len(hf_mc),
        "mc_choices": len(diffs),
        "acc_hf": acc_hf,
        "acc_server": acc_api,
        "max_abs_loglikelihood_diff": max(diffs),
        "choices_over_tolerance": sum(d > LL_TOLERANCE for d in diffs),
        "gen_docs": len(hf_gen),
        "gen_equal": len(hf_gen) - len(differing),
        "gen_differing": differing,
        "gen_examples": [api_gen[d]["filtered_resps"] for d in sorted(api_gen)[:3]],
    }


def run_langchain(base_url: str, prompts: int) -> dict:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field, ValidationError

    class Person(BaseModel):
        """A person in a story."""

        name: str = Field(description="first name", max_length=20)
        age: int = Field(description="age in years", ge=0, le=120)
        city: str = Field(description="home city", max_length=20)

    class Weather(BaseModel):
        city: str = Field(max_length=20)
        unit: str = Field(description="celsius or fahrenheit", pattern="^(celsius|fahrenheit)$")

    class Sum(BaseModel):
        a: int = Field(ge=-1000, le=1000)
        b: int = Field(ge=-1000, le=1000)

    @tool(args_schema=Weather)
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    @tool(args_schema=Sum)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(
        model=NAME, base_url=base_url, api_key="unused", temperature=0, max_tokens=96, timeout=600, max_retries=0
    )
    rng = random.Random(0)
    names = ["Ana", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun"]
    cities = ["Lisbon", "Oslo", "Lima", "Cairo", "Hanoi", "Quito", "Perth", "Dakar", "Riga", "Pune"]
    person_prompts = [
        f"Invent a character named {rng.choice(names)} who lives in {rng.choice(cities)}; give name, age and city."
        for _ in range(prompts)
    ]
    tool_prompts = [
        rng.choice(
            [f"What is the weather in {rng.choice(cities)}?", f"Add {rng.randint(1, 99)} and {rng.randint(1, 99)}."]
        )
        for _ in range(prompts)
    ]
    report = {}
    for method in ("json_schema", "function_calling"):
        structured = llm.with_structured_output(Person, method=method, include_raw=True)
        ok, failures = 0, []
        for p in person_prompts:
            try:
                got = structured.invoke(p)
            except Exception as e:  # a refused request counts as a failure, with its reason
                failures.append(f"{type(e).__name__}: {e}"[:300])
                continue
            if isinstance(got["parsed"], Person) and got["parsing_error"] is None:
                ok += 1
            else:
                failures.append(str(got["parsing_error"] or got["raw"])[:300])
        report[f"with_structured_output[{method}]"] = {
            "prompts": len(person_prompts),
            "valid": ok,
            "failures": failures,
        }
    bound = llm.bind_tools([get_weather, add], tool_choice="required")
    schemas = {"get_weather": Weather, "add": Sum}
    ok, failures = 0, []
    for p in tool_prompts:
        try:
            msg = bound.invoke(p)
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}"[:300])
            continue
        calls = msg.tool_calls
        try:
            if not calls or msg.invalid_tool_calls:
                raise ValueError(f"calls {calls}, invalid {msg.invalid_tool_calls}")
            for call in calls:
                schemas[call["name"]].model_validate(call["args"])
            ok += 1
        except (KeyError, ValueError, ValidationError) as e:
            failures.append(str(e)[:300])
    report["bind_tools[required]"] = {"prompts": len(tool_prompts), "valid": ok, "failures": failures}
    return report


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-python", default=os.environ.get("VPAGED_SERVER_PYTHON", sys.executable))
    ap.add_argument("--mc-samples", type=int, default=30)
    ap.add_argument("--gen-samples", type=int, default=20)
    ap.add_argument("--max-gen-tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=20, help="LangChain prompts per check")
    ap.add_argument("--agent-prompts", type=int, default=12, help="prompts per agent framework")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=None, help="of the task data (default: a fresh one)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: lm_eval, langchain, agents")
    ap.add_argument("--output", default="eval-clients_smollm2_epyc-avx2-2c.json")
    ap.add_argument("--box", default="AMD EPYC (Zen 3 class), 2 cores, AVX2; model fp32", help="recorded as is")
    args = ap.parse_args(argv)
    why = real_model.why_unavailable()
    if why:
        raise SystemExit(why)
    model = real_model.model_dir()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    skip = set(filter(None, args.skip.split(",")))
    payload = {"machine": machine(), "box": args.box, "args": vars(args), "seed": seed, "model": real_model.NAME}
    with tempfile.TemporaryDirectory(prefix="vpaged-eval-") as tmp:
        folder = Path(tmp)
        write_tasks(folder, args, random.Random(seed))
        port = free_port()
        log_path = folder / "server.log"
        log = log_path.open("w")
        server = start_server(args, model, port, log)
        try:
            # Each part's results are written as soon as it ends (a run stopped later keeps them).
            if "agents" not in skip:
                t0 = time.perf_counter()
                payload["agents"] = run_agents(f"http://127.0.0.1:{port}/v1", args.agent_prompts)
                payload["agents_s"] = time.perf_counter() - t0
                write_json(args.output, payload)
            if "lm_eval" not in skip:
                t0 = time.perf_counter()
                model_args = (
                    f"model={NAME},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={model},"
                    "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
                )
                run_lm_eval(args, folder, "local-completions", model_args, folder / "server")
                payload["lm_eval_server_s"] = time.perf_counter() - t0
            if "langchain" not in skip:
                t0 = time.perf_counter()
                payload["langchain"] = run_langchain(f"http://127.0.0.1:{port}/v1", args.prompts)
                payload["langchain_s"] = time.perf_counter() - t0
                write_json(args.output, payload)
        finally:
            server.terminate()
            server.wait(60)
            log.close()
            payload["server_log"] = server_log(log_path.read_text(errors="replace"))
        if "lm_eval" not in skip:
            t0 = time.perf_counter()
            run_lm_eval(args, folder, "hf", f"pretrained={model},dtype=float32", folder / "hf")
            payload["lm_eval_hf_s"] = time.perf_counter() - t0
            payload["lm_eval"] = compare_lm_eval(folder / "hf", folder / "server")
    rows = []
    if "lm_eval" in payload:
        e = payload["lm_eval"]
        rows.append(["lm-eval mc accuracy (hf / server)", f"{e['acc_hf']:.3f} / {e['acc_server']:.3f}"])
        rows.append(["lm-eval mc max |loglikelihood diff|", f"{e['max_abs_loglikelihood_diff']:.2e}"])
        rows.append(["lm-eval generate_until equal", f"{e['gen_equal']} / {e['gen_docs']}"])
    for name, r in payload.get("langchain", {}).items():
        rows.append([f"langchain {name}", f"{r['valid']} / {r['prompts']} parse + validate"])
    if "agents" in payload:
        check = payload["agents"]["tools_check"]
        rows.append(
            [
                "tools reach the prompt (prompt tokens without / with)",
                f"{check['prompt_tokens_without_tools']} / {check['prompt_tokens_with_tools']}",
            ]
        )
    log_summary = payload["server_log"]
    rows.append(["server log: warnings+ / tracebacks", f"{len(log_summary['lines'])} / {log_summary['tracebacks']}"])
    print_table(["check", "result"], rows)
    if "agents" in payload:
        print_table(AGENT_HEADERS, agent_rows(payload["agents"]))
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
