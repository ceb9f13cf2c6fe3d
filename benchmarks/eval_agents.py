"""Part 3 of eval_clients.py: agent frameworks with tools under tool_choice "auto", seen on the wire.

LangGraph's prebuilt ReAct agent and LangChain's `create_agent`, openai-agents' `Runner` over its
chat-completions model, pydantic-ai's `Agent`: each on the same prompts with two tools (weather, add). The
frameworks talk to the server through a recording proxy (WireRecorder), so what is counted is what the wire
carried, not what a framework chose to report: every chat request (its tools, its messages) and every reply
(its status, its usage, its tool calls). Per framework:

- requests, and how many carried tools;
- the prompt tokens of each request with and without its tools, counted by the server's own /tokenize on the
  request's messages (the same rendering as the chat route), and the server's usage.prompt_tokens of the
  reply (equal to the with-tools count: the prompt the model saw held the tools);
- replies that parsed: status 200, a JSON body, every tool call naming an offered tool with arguments that are
  a JSON object (and how many of those also validate against the tool's parameter schema: under "auto" the
  model writes them unconstrained, so a 135M model's arguments are its own affair, but they must parse);
- tool calls in the replies, and those the framework executed (its own count);
- runs that finished, runs stopped by the framework's own turn limit, and client exceptions with their message.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = "smollm2"
AGENT_CITIES = ["Lisbon", "Oslo", "Lima", "Cairo", "Hanoi", "Quito", "Perth", "Dakar", "Riga", "Pune"]
UPSTREAM_TIMEOUT_S = 900


class WireRecorder:
    """An HTTP proxy on 127.0.0.1 that forwards to the server and keeps every /chat/completions exchange under
    the current `label` (the frameworks run one after another). Streamed replies are forwarded whole once the
    server has finished them (the clients read the same events, only later)."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.label = ""
        self.records: list[dict] = []
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the records are the log
                pass

            def do_GET(self):
                recorder._forward(self, None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                recorder._forward(self, self.rfile.read(length))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def of(self, label: str) -> list[dict]:
        return [r for r in self.records if r["label"] == label]

    def _forward(self, handler: BaseHTTPRequestHandler, body: bytes | None) -> None:
        path = handler.path
        headers = {k: v for k, v in handler.headers.items() if k.lower() in ("content-type", "accept", "authorization")}
        req = urllib.request.Request(self.upstream + path, data=body, headers=headers, method=handler.command)
        try:
            with urllib.request.urlopen(req, timeout=UPSTREAM_TIMEOUT_S) as r:
                status, ctype, data = r.status, r.headers.get("Content-Type", ""), r.read()
        except urllib.error.HTTPError as e:
            status, ctype, data = e.code, e.headers.get("Content-Type", ""), e.read()
        except OSError as e:  # the server did not answer: the client sees a 502, the record says why
            status, ctype, data = 502, "application/json", json.dumps({"error": {"message": repr(e)}}).encode()
        if path.endswith("/chat/completions") and body is not None:
            with self._lock:
                self.records.append(exchange(self.label, body, status, ctype, data))
        handler.send_response(status)
        handler.send_header("Content-Type", ctype or "application/octet-stream")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


def _reply_message(ctype: str, data: bytes) -> tuple[dict, dict | None]:
    """(the assistant message, usage) of a reply, streamed or not; ValueError when it does not parse."""
    text = data.decode("utf-8")
    if not ctype.startswith("text/event-stream"):
        body = json.loads(text)
        return body["choices"][0]["message"], body.get("usage")
    content, calls, usage = "", {}, None
    for line in text.splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        chunk = json.loads(line[5:])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                slot = calls.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)] or None}, usage


def exchange(label: str, body: bytes, status: int, ctype: str, data: bytes) -> dict:
    """One request and its reply, judged: did the reply parse, and its tool calls' arguments."""
    import jsonschema

    request = json.loads(body)
    tools = {t["function"]["name"]: t["function"] for t in request.get("tools") or ()}
    rec = {
        "label": label,
        "messages": request.get("messages"),
        "tools": request.get("tools"),
        "tool_choice": request.get("tool_choice"),
        "stream": bool(request.get("stream")),
        "status": status,
        "parsed": False,
        "problem": None,
        "tool_calls": 0,
        "arguments_valid": 0,
        "prompt_tokens": None,
    }
    if status != 200:
        rec["problem"] = f"HTTP {status}: {data[:300].decode('utf-8', 'replace')}"
        return rec
    try:
        message, usage = _reply_message(ctype, data)
        if message.get("content") is not None and not isinstance(message["content"], str):
            raise ValueError(f"content is {type(message['content']).__name__}")
        for call in message.get("tool_calls") or ():
            fn = call["function"]
            if fn["name"] not in tools:
                raise ValueError(f"a call of {fn['name']!r}, not an offered tool ({sorted(tools)})")
            args = json.loads(fn["arguments"])
            if not isinstance(args, dict):
                raise ValueError(f"arguments {fn['arguments']!r} are not a JSON object")
            rec["tool_calls"] += 1
            try:
                jsonschema.validate(args, tools[fn["name"]].get("parameters") or {})
                rec["arguments_valid"] += 1
            except jsonschema.ValidationError:
                pass  # what a small model writes under "auto" is its own affair; it parsed
    except (ValueError, KeyError, TypeError, IndexError) as e:
        rec["problem"] = f"{type(e).__name__}: {e}"[:300]
        return rec
    rec["parsed"] = True
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]
    rec["reply"] = {"content": (message.get("content") or "")[:160], "tool_calls": calls}
    rec["prompt_tokens"] = (usage or {}).get("prompt_tokens")
    return rec


def tokenize_count(server_url: str, messages: list, tools: list | None) -> int:
    """The server's prompt token count of a chat request's messages (with its tools when given)."""
    payload = {"model": NAME, "messages": messages, **({"tools": tools} if tools else {})}
    req = urllib.request.Request(
        server_url.rstrip("/").removesuffix("/v1") + "/tokenize",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=UPSTREAM_TIMEOUT_S) as r:
        return json.load(r)["count"]


def wire_summary(server_url: str, records: list[dict]) -> dict:
    """A framework's requests and replies, with each tool-carrying request tokenized with and without tools."""
    with_tools = [r for r in records if r["tools"]]
    counts, problems = [], []
    for r in with_tools:
        try:
            counts.append(
                (tokenize_count(server_url, r["messages"], None), tokenize_count(server_url, r["messages"], r["tools"]))
            )
        except (OSError, ValueError) as e:
            problems.append(f"/tokenize: {type(e).__name__}: {e}"[:300])
    usage_match = sum(
        1
        for r, (_, w) in zip((r for r in with_tools), counts)
        if r["prompt_tokens"] is not None and r["prompt_tokens"] == w
    )
    first = counts[0] if counts else (None, None)
    return {
        "requests": len(records),
        "requests_with_tools": len(with_tools),
        "tool_choice_sent": sorted({r["tool_choice"] or "(none sent: auto)" for r in records}),
        "first_request_prompt_tokens_without_tools": first[0],
        "first_request_prompt_tokens_with_tools": first[1],
        "requests_whose_tools_reach_prompt": sum(w > wo for wo, w in counts),
        "usage_prompt_tokens_equal_tokenize_with_tools": usage_match,
        "replies_parsed": sum(r["parsed"] for r in records),
        "reply_problems": [r["problem"] for r in records if not r["parsed"]] + problems,
        "http_status": {str(s): sum(r["status"] == s for r in records) for s in sorted({r["status"] for r in records})},
        "tool_calls_in_replies": sum(r["tool_calls"] for r in records),
        "tool_call_arguments_valid_for_schema": sum(r["arguments_valid"] for r in records),
        "replies_with_tool_calls": sum(r["tool_calls"] > 0 for r in records),
        "reply_examples": [r["reply"] for r in records if r["parsed"]][:4],
    }


def agent_prompts(n: int, rng: random.Random) -> list[str]:
    return [
        rng.choice(
            [
                f"What is the weather in {rng.choice(AGENT_CITIES)}? Use the tool.",
                f"Use the add tool to add {rng.randint(1, 99)} and {rng.randint(1, 99)}.",
                "Say hello in one short sentence.",
            ]
        )
        for _ in range(n)
    ]


def weather_tool(city: str) -> str:
    """The current weather in a city."""
    return f"sunny and 21 degrees in {city}"


def add_tool(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def tools_reach_prompt(base_url: str) -> dict:
    """The prompt token count of one chat request with and without the tools (equal: the tools were dropped)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    bare = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    with_tools = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, tools=tools)
    return {
        "prompt_tokens_without_tools": bare.usage.prompt_tokens,
        "prompt_tokens_with_tools": with_tools.usage.prompt_tokens,
        "tools_reach_prompt": with_tools.usage.prompt_tokens > bare.usage.prompt_tokens,
    }


def _agent_run(report: dict, run, limit_errors: tuple) -> None:
    """One agent run: counts it as finished, as stopped by the framework's own turn limit, or as a failure."""
    try:
        report["tool_calls_executed"] += run()
        report["finished"] += 1
    except limit_errors:
        report["turn_limit"] += 1
    except Exception as e:  # a reply that did not parse, a refused request: a failure, with its reason
        report["client_exceptions"].append(f"{type(e).__name__}: {e}"[:300])


def run_agents(server_url: str, prompts: int) -> dict:
    """server_url: the server's /v1 base. Returns the tools check and one record per framework."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent
    from openai import AsyncOpenAI
    from pydantic_ai import Agent as PydanticAgent
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    texts = agent_prompts(prompts, random.Random(1))
    report = {"tools_check": tools_reach_prompt(server_url), "prompts_text": texts}
    wire = WireRecorder(server_url.removesuffix("/v1"))
    base_url = wire.base_url

    def fresh() -> dict:
        return {
            "prompts": len(texts),
            "finished": 0,
            "turn_limit": 0,
            "tool_calls_executed": 0,
            "client_exceptions": [],
        }

    llm = ChatOpenAI(
        model=NAME, base_url=base_url, api_key="unused", temperature=0, max_tokens=96, timeout=900, max_retries=0
    )
    lc_tools = [tool(weather_tool), tool(add_tool)]

    def langchain_calls(state: dict) -> int:
        return sum(len(m.tool_calls) for m in state["messages"] if isinstance(m, AIMessage))

    def framework(name: str, runs) -> None:
        wire.label = name
        r = fresh()
        for run, limits in runs:
            _agent_run(r, run, limits)
        report[name] = {**r, **wire_summary(server_url, wire.of(name))}

    try:
        for name, graph in (
            ("langgraph create_react_agent", create_react_agent(llm, lc_tools)),
            ("langchain create_agent", create_agent(model=llm, tools=lc_tools)),
        ):
            framework(
                name,
                [
                    (
                        lambda g=graph, t=text: langchain_calls(
                            g.invoke({"messages": [{"role": "user", "content": t}]}, {"recursion_limit": 8})
                        ),
                        (GraphRecursionError,),
                    )
                    for text in texts
                ],
            )

        set_tracing_disabled(True)
        oa_model = OpenAIChatCompletionsModel(
            model=NAME, openai_client=AsyncOpenAI(base_url=base_url, api_key="unused", timeout=900, max_retries=0)
        )
        oa_agent = Agent(
            name="assistant",
            instructions="You are a helpful assistant. Use the tools when they help.",
            tools=[function_tool(weather_tool), function_tool(add_tool)],
            model=oa_model,
            model_settings=ModelSettings(temperature=0, max_tokens=96),
        )
        framework(
            "openai-agents Runner",
            [
                (
                    lambda t=text: sum(
                        1
                        for item in Runner.run_sync(oa_agent, t, max_turns=4).new_items
                        if item.type == "tool_call_item"
                    ),
                    (MaxTurnsExceeded,),
                )
                for text in texts
            ],
        )

        pa_model = OpenAIChatModel(NAME, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
        pa_agent = PydanticAgent(
            pa_model,
            tools=[weather_tool, add_tool],
            model_settings={"temperature": 0, "max_tokens": 96, "timeout": 900},
        )
        framework(
            "pydantic-ai Agent",
            [
                (
                    lambda t=text: sum(
                        isinstance(part, ToolCallPart)
                        for message in pa_agent.run_sync(t, usage_limits=UsageLimits(request_limit=4)).all_messages()
                        for part in getattr(message, "parts", ())
                    ),
                    (UsageLimitExceeded,),
                )
                for text in texts
            ],
        )
    finally:
        wire.close()
    return report


def agent_rows(agents: dict) -> list[list[str]]:
    """The results table's rows of part 3."""
    agents = {k: v for k, v in agents.items() if isinstance(v, dict) and "requests" in v}
    rows = []
    for name, r in agents.items():
        rows.append(
            [
                name,
                f"{r['first_request_prompt_tokens_without_tools']} / {r['first_request_prompt_tokens_with_tools']}",
                f"{r['requests_whose_tools_reach_prompt']} / {r['requests_with_tools']} / {r['requests']}",
                f"{r['replies_parsed']} / {r['requests']}",
                f"{r['tool_calls_in_replies']} ({r['tool_call_arguments_valid_for_schema']} valid)",
                f"{r['finished']} + {r['turn_limit']} / {r['prompts']}",
                str(len(r["client_exceptions"])),
            ]
        )
    return rows


AGENT_HEADERS = [
    "framework",
    "prompt tok w/o / with tools",
    "tools reach / with tools / requests",
    "replies parsed",
    "tool calls (args valid)",
    "finished + turn limit / runs",
    "exceptions",
]
