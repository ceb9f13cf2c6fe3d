"""Rendering a chat request into the prompt text: the tokenizer's chat template (`vpaged serve --chat-template
FILE` replaces it), with a default way to give the model the request's `tools` when the template has none.

Many small models' templates ignore `tools` (SmolLM2's does): rendered as they are, a request's tools would
never reach the model and an agent would get no call and no warning. Whether a template renders tools is
found once per template by rendering a probe conversation with a probe tool and looking for its name; one
that does not gets the tools in the Hermes convention (as Hermes, Qwen 2.5 and transformers' tool-use
templates write them): a system-message block listing each tool as its JSON schema between `<tools>` and
`</tools>`, asking for each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what the
`hermes` tool-call parser reads, tools.py). The conversation's history is written in the same convention when
the template drops it: an assistant's tool_calls as `<tool_call>` blocks in its content, tool results as a
user turn of `<tool_response>` blocks. The server logs a warning the first time a model's tools take this way.
"""

from __future__ import annotations

import json
import logging

from ...errors import RequestError

log = logging.getLogger("vpaged.serve")

_PROBE_NAME = "vpaged_probe_tool_7f3a"
_PROBE_RESULT = "vpaged_probe_result_7f3a"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}},
}
_PROBE_CALL = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}


def tool_prompt(tools: list[dict]) -> str:
    """The system-message block that lists `tools` ({type: function, function: {...}}) and says how to call."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You can call functions to help with the user's request. The functions you can call are described, "
        "each by its JSON schema, between <tools> and </tools>:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To call a function, answer with a JSON object giving its name and its arguments between <tool_call> "
        "and </tool_call>, one block per call:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<the arguments, a JSON object>}}\n</tool_call>'
    )


def _call_text(call: dict) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    fn = fn if isinstance(fn, dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    call_json = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{call_json}\n</tool_call>"


class ChatRenderer:
    """The prompt text of a conversation for one model's tokenizer (its chat template as it is now)."""

    def __init__(self, tokenizer, model_name: str):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._support: dict[str, tuple[bool, bool]] = {}  # template text -> (renders tools, renders history)
        self._warned = False

    def available(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def require(self) -> None:
        """The 400 for a chat request to a model without a chat template (before its messages are read)."""
        if not self.available():
            raise RequestError(
                "this model's tokenizer has no chat template: use /v1/completions (or serve it with "
                "--chat-template FILE)",
                param="messages",
                code="no_chat_template",
            )

    def _apply(self, conversation: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def _probe(self) -> tuple[bool, bool]:
        """(the template renders `tools`, it renders assistant tool_calls and tool results), probed once."""
        key = str(self.tokenizer.chat_template)
        if key not in self._support:
            user = {"role": "user", "content": "probe"}
            try:
                tools_ok = _PROBE_NAME in self._apply([user], True, [_PROBE_TOOL])
            except Exception:  # noqa: BLE001 - a template may raise anything
                tools_ok = False
            history = [
                user,
                {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
                {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": "call_probe"},
            ]
            try:
                text = self._apply(history, True, [_PROBE_TOOL] if tools_ok else None)
                history_ok = _PROBE_NAME in text and _PROBE_RESULT in text
            except Exception:  # noqa: BLE001
                history_ok = False
            self._support[key] = (tools_ok, history_ok)
        return self._support[key]

    def render(self, conversation: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None):
        """The prompt text; tools: the request's {type: function, function} records (None or []: none)."""
        self.require()
        uses_tools = bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in conversation)
        if uses_tools:
            tools_ok, history_ok = self._probe()
            if not history_ok:
                conversation = _history_as_text(conversation)
            if tools and not tools_ok:
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "the chat template of %s does not render tools: requests' tools are given to the model "
                        "in a system message (Hermes convention: <tools> JSON schemas, <tool_call> answers)",
                        self.model_name,
                    )
                conversation = _with_tool_prompt(conversation, tools)
                tools = None
        try:
            return self._apply(conversation, add_generation_prompt, tools)
        except Exception as e:  # noqa: BLE001 - a template may raise anything (e.g. role order)
            raise RequestError(f"the chat template refused these messages: {e}", param="messages") from None


def _with_tool_prompt(conversation: list[dict], tools: list[dict]) -> list[dict]:
    block = tool_prompt(tools)
    if conversation and conversation[0].get("role") in ("system", "developer"):
        first = conversation[0]
        text = f"{first.get('content') or ''}\n\n{block}" if first.get("content") else block
        return [{**first, "role": "system", "content": text}, *conversation[1:]]
    return [{"role": "system", "content": block}, *conversation]


def _history_as_text(conversation: list[dict]) -> list[dict]:
    """Assistant tool_calls as <tool_call> blocks in the content; each run of tool results as one user turn of
    <tool_response> blocks (a template that knows no tool role may refuse one, or drop it)."""
    out: list[dict] = []
    for m in conversation:
        if m.get("role") == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
            continue
        if m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            text = f"{m.get('content') or ''}\n{calls}" if m.get("content") else calls
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = text
        out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
