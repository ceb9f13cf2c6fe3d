"""Structured output: each step, the tokens a request's grammar allows next, as a mask the batched sampler
applies to that request's rows; the grammar engine is xgrammar (vLLM's default; extra `vpaged[structured]`).

A GrammarSpec (a JSON schema, any JSON object, a regex, a choice of strings, or an EBNF grammar) is compiled
once per tokenizer and kept (Grammars.compile, an LRU of compiled grammars behind a lock). The server compiles
a request's grammar on a worker thread before it hands the request to the engine, so a schema that cannot be
compiled is a 400 and the engine thread, whose compile then hits the cache, never waits for a compilation.
Each sequence gets its own matcher (Sequence.matcher), made on its first sampling step by replaying its
generated tokens (completions forked from a prompt, sequences recomputed after preemption); it accepts every
token the sequence draws. Once the grammar is complete only the stop tokens are allowed, so the request ends.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ...errors import InvalidArgumentError

KINDS = ("json", "json_schema", "regex", "choice", "grammar")


def structured_unavailable() -> str | None:
    """Why structured output cannot run here (None: it can)."""
    if importlib.util.find_spec("xgrammar") is None:
        return "structured output needs xgrammar: pip install 'vpaged[structured]'"
    return None


@dataclass(frozen=True)
class GrammarSpec:
    """kind: "json" (any JSON object), "json_schema" (value: the schema as JSON text), "regex", "choice"
    (value: a JSON list of strings), "grammar" (value: EBNF, xgrammar's dialect)."""

    kind: str
    value: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise InvalidArgumentError(f"structured output value must be a str, got {type(self.value).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> GrammarSpec:
        """From a schema (a dict, or its JSON text), kept as compact JSON text in the schema's own key order:
        the grammar writes an object's properties in the order the schema lists them (as OpenAI and vLLM do:
        a "reasoning, then answer" schema gets its reasoning first), so two schemas that list the same
        properties in another order are two grammars, and equal texts share one."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidArgumentError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InvalidArgumentError("json_schema must be a JSON object")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        if not options or not all(isinstance(o, str) for o in options):
            raise InvalidArgumentError("a choice must be a non-empty list of strings")
        return cls("choice", json.dumps(list(options)))


# xgrammar's C++ errors start with its log prefix, "[08:29:22] /project/cpp/json_schema_converter.cc:5082: ":
# the time and its build's source path mean nothing to a client, what follows says what is wrong.
_LOG_TIME = re.compile(r"^\s*\[[0-9:.\- ]+\]\s*")
_SOURCE_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.\-]+)+\.(?:cc|cpp|cxx|h|hpp|py)(?::\d+)*:?\s*")


def compile_error_text(error: BaseException) -> str:
    """What a grammar compiler's error says is wrong, without its log time stamp and source locations (the
    first line that says anything; the type of the error when none does)."""
    for line in str(error).splitlines():
        text = _SOURCE_PATH.sub("", _LOG_TIME.sub("", line)).strip()
        if text:
            return text
    return type(error).__name__


def relocate_refs(schema: dict, pointer: str) -> dict:
    """A copy of schema whose local references ("$ref": "#..." : "#" itself, "#/$defs/Addr") resolve in a larger
    document in which schema sits at `pointer` (a JSON pointer fragment such as "#/$defs/f"), so that the
    schema can be embedded in another one; schema itself when it has none. References to other documents, and
    the values of keywords that hold data (const, enum, default, examples), are kept as they are."""
    changed = False

    def walk(node, named: bool = False):
        """named: node maps names (of properties, definitions) to schemas, so no key of it is a keyword."""
        nonlocal changed
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if named:
                out[key] = walk(value)
            elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = pointer + value[1:]
                changed = True
            elif key in _DATA_KEYWORDS:
                out[key] = value
            else:
                out[key] = walk(value, named=key in _NAMED_SCHEMAS)
        return out

    moved = walk(schema)
    return moved if changed else schema


_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))
_NAMED_SCHEMAS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
)


class Grammars:
    """Compiled grammars and matchers for one tokenizer and vocabulary (the model's logits width)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_cached: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._compiler = None
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()

    def unavailable(self) -> str | None:
        if self.tokenizer is None:
            return "structured output needs the model's tokenizer"
        return structured_unavailable()

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of spec (cached); InvalidArgumentError when xgrammar cannot compile it."""
        why = self.unavailable()
        if why is not None:
            raise InvalidArgumentError(why)
        # The cache lock is held only to look up and insert, never while compiling: the engine thread's
        # lookup of a grammar the server compiled does not wait for another request's compilation.
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(self._get_compiler(), spec)  # xgrammar's compiler is thread-safe
        with self._lock:
            self._cache[spec] = compiled
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                # Building the tokenizer's byte table reads every token once (seconds for a 50k vocabulary):
                # done at the first structured request, on the thread that compiles it.
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    @staticmethod
    def _compile(compiler, spec: GrammarSpec):
        try:
            if spec.kind == "json":
                # Any JSON *object* (response_format json_object), not xgrammar's builtin grammar, which takes
                # any JSON value: a model answered `[1]` to it.
                return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                # No free whitespace (vLLM's disable-any-whitespace): a sampled SmolLM2-135M padded its objects
                # with tabs and blank lines until max_tokens, even with each run capped at 16 characters.
                return compiler.compile_json_schema(spec.value, strict_mode=True, any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                options = json.loads(spec.value)
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidArgumentError(f"the {spec.kind} cannot be compiled: {compile_error_text(e)}") from None

    def matcher(self, spec: GrammarSpec, generated: list[int]):
        """A matcher of spec that has accepted `generated` (a sequence's tokens so far)."""
        import xgrammar as xgr

        m = xgr.GrammarMatcher(self.compile(spec))
        for token in generated:
            if not m.accept_token(token):
                break
        return m

    def allowed(self, matchers: list) -> torch.Tensor:
        """bool [len(matchers), vocab_size]: the tokens each matcher allows next. A grammar that ended with a
        stop token (a request with ignore_eos goes on past it) allows the stop tokens again; a row that allows
        nothing stays empty: the sampler then ends that request with finish_reason "error" (sampler.py)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        ended = []
        for i, m in enumerate(matchers):
            if m.is_terminated():  # xgrammar refuses to fill a mask after the stop token
                ended.append(i)
            else:
                m.fill_next_token_bitmask(bitmask, i)
        bits = torch.arange(32, dtype=torch.int32)
        mask = ((bitmask[:, :, None] >> bits) & 1).bool().view(len(matchers), -1)[:, : self.vocab_size]
        if ended:
            rows = torch.tensor(ended)
            mask[rows] = False
            if self.stop_token_ids:
                mask[rows[:, None], torch.tensor(self.stop_token_ids)] = True
        return mask
