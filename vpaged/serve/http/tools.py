"""Tool calling on /v1/chat/completions: `tools` rendered by the model's own chat template (or, when it has no
tool support, in the Hermes convention: chat_template.py), `tool_choice`, and the calls parsed from the output.
The legacy `functions` / `function_call` arrive here as the tools / tool_choice they map to (chat/protocol.py).

tool_choice "auto" (the default with tools): the model decides; calls are parsed from its text by the server's
tool-call parser (`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the form of
Hermes, Qwen 2.5 / 3 and other templates). "none": no call is parsed. "required" and a named function are
enforced with structured output, as vLLM does: "required" constrains the output to a JSON array of at least
one `{"name", "arguments"}` whose arguments follow that function's schema, a named function to that function's
arguments; so the arguments always parse and validate.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ...errors import RequestError
from ..sample.structured import GrammarSpec, relocate_refs
from .chat.protocol import ChatMessage, ChatToolCall, FunctionCall

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it

    def body(self, index: int | None = None) -> ChatToolCall:
        """The call as an answer's tool_calls entry, with a new id."""
        return ChatToolCall(index=index, id=f"call_{uuid.uuid4().hex[:24]}", function=self.legacy_body())

    def legacy_body(self) -> FunctionCall:
        """The call as a legacy message's function_call (the request gave `functions`)."""
        return FunctionCall(name=self.name, arguments=self.arguments)


def functions(tools, param: str = "tools") -> dict[str, dict]:
    """name -> the function's record ({name, description, parameters}) of a request's tools; 400 otherwise
    naming `param` (the legacy `functions` arrive here as the tools they map to)."""
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {type: function, function: {name, parameters}}", param=param)
    out = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name) or name in out:
            shape = "each tool must be {type: function, function: {name (unique), ...}}"
            raise RequestError(shape if param == "tools" else f"{param}: each must be {{name (unique), ...}}", param)
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise RequestError(f"tool {name}: parameters must be a JSON schema object", param=param)
        out[name] = {**fn, "parameters": params}
    return out


def choice_of(tool_choice, fns: dict[str, dict], param: str = "tool_choice") -> str:
    """ "auto" | "none" | "required" | the name of the function asked for; 400 otherwise naming `param`."""
    if tool_choice is None:
        return "auto" if fns else "none"
    if tool_choice in ("auto", "none", "required"):
        if tool_choice != "none" and not fns:
            raise RequestError(f"tool_choice {tool_choice!r} needs tools", param=param)
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) and tool_choice.get("type") == "function" else None
    if name not in fns:
        shape = "{type: function, function: {name}}" if param == "tool_choice" else "{name}"
        raise RequestError(f"{param} must be auto, none, required or {shape} of a given tool", param=param)
    return name


def grammar(choice: str, fns: dict[str, dict]) -> GrammarSpec | None:
    """The structured output that enforces a choice (None for auto and none)."""
    if choice in ("auto", "none"):
        return None
    if choice != "required":
        return GrammarSpec.json_schema(fns[choice]["parameters"])
    calls, defs = [], {}
    for name, fn in fns.items():
        # Parameters with local references ("#/$defs/Addr" of Pydantic's nested models, "#" for a recursive
        # one) would resolve against this wrapper: they move to its $defs/<name>, their references rewritten
        # to resolve there, and the call refers to them. The name comes first, as OpenAI and vLLM write it.
        arguments = relocate_refs(fn["parameters"], f"#/$defs/{name}")
        if arguments is not fn["parameters"]:
            defs[name], arguments = arguments, {"$ref": f"#/$defs/{name}"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    # Exactly one call: with no upper bound a small model kept appending calls until max_tokens.
    schema = {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": calls}}
    return GrammarSpec.json_schema({**schema, "$defs": defs} if defs else schema)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _loads(text: str):
    """JSON that may hold raw control characters inside its strings: xgrammar's string rule with maxLength
    admits them (a tab, a form feed: measured with its JSON-schema grammar), and strict JSON refuses them. The
    calls built from it are written back with json.dumps, which escapes them."""
    return json.loads(text, strict=False)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls or None, the calls) of `<tool_call>{json}</tool_call>` blocks; a block
    whose JSON does not parse stays in the text."""
    calls, kept, last = [], [], 0
    for m in _HERMES.finditer(text):
        try:
            obj = _loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        kept.append(text[last : m.start()])
        last = m.end()
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


PARSERS = {"hermes": parse_hermes}


def _strict_json_text(text: str) -> str:
    """`text` when it is strict JSON; written again with its control characters escaped when only _loads reads
    it; as it is otherwise (cut by max_tokens)."""
    try:
        json.loads(text)
        return text
    except ValueError:
        pass
    try:
        return json.dumps(_loads(text), ensure_ascii=False)
    except ValueError:
        return text


def parse(text: str, choice: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """The message content and the tool calls of an output under a tool_choice."""
    if choice == "none":
        return text, []
    if choice == "auto":
        return PARSERS[parser](text)
    if choice != "required":  # a named function: the output is its arguments (as written, when strict JSON)
        return None, [ToolCall(choice, _strict_json_text(text))]
    try:
        items = _loads(text)
    except ValueError:  # cut by max_tokens: what there is goes back as text
        return text, []
    return None, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items]


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """A request's messages as the chat template reads them (history); a content part the server cannot read
    is refused as such (RequestError), not as a template error."""
    return [history(m) for m in messages]


def history(message: ChatMessage) -> dict:
    """A chat message as the template reads it: tool calls' arguments as objects (HF templates expect dicts)."""
    out = {"role": "tool" if message.role == "function" else message.role, "content": message.text()}
    given = message.tool_calls
    if not given and message.function_call:  # the legacy form: one call, no id
        given = [{"id": "call_0", "type": "function", "function": message.function_call}]
    if given:
        calls = []
        for call in given:
            fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            calls.append({**call, "function": fn} if isinstance(call, dict) else call)
        out["tool_calls"] = calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out
