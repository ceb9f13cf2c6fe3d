"""Request traces for the simulator: seeded built-in traces shaped like public datasets, or a CSV file.

Built-in length distributions are log-normal (long-tailed) with the means the vLLM paper reports for its
traces: ShareGPT about 161 input / 338 output tokens, Alpaca about 19 / 58. Arrivals are Poisson.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import TraceError


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds from the start
    prompt_len: int
    output_len: int
    prefix_id: int | None = None  # requests with the same id share their first prefix_len prompt tokens
    prefix_len: int = 0
    n: int = 1  # parallel samples (each generates output_len tokens)


@dataclass(frozen=True)
class TraceShape:
    mean_input: float
    mean_output: float
    sigma: float = 1.0  # log-normal shape: the tail


BUILTIN = {
    "sharegpt": TraceShape(161.0, 338.0),
    "alpaca": TraceShape(19.0, 58.0, sigma=0.8),
}


def _lognormal(rnd: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma))] = mean
    return max(low, min(high, round(rnd.lognormvariate(mu, sigma))))


def builtin_trace(
    name: str, num_requests: int, rate: float, max_seq_len: int, seed: int = 0, shared_prefix: int = 0, n: int = 1
) -> list[SimRequest]:
    """num_requests requests of the built-in trace `name` arriving at `rate` per second (inf: all at 0).
    shared_prefix: every request starts with the same system prompt of that many tokens (added to its prompt).
    n: parallel samples per request. Prompt + output never exceed max_seq_len."""
    if name not in BUILTIN:
        raise TraceError(f"unknown trace {name!r}: built-in traces are {', '.join(BUILTIN)} (or give a CSV file)")
    if num_requests <= 0 or not rate > 0 or n <= 0 or shared_prefix < 0:
        raise TraceError("requests, rate and n must be positive, shared_prefix non-negative")
    if shared_prefix + 2 > max_seq_len:
        raise TraceError(f"shared_prefix {shared_prefix} leaves no room in max_seq_len {max_seq_len}")
    shape = BUILTIN[name]
    rnd = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        if math.isfinite(rate):
            t += rnd.expovariate(rate)
        room = max_seq_len - shared_prefix
        prompt = _lognormal(rnd, shape.mean_input, shape.sigma, 1, room - 1)
        output = _lognormal(rnd, shape.mean_output, shape.sigma, 1, room - prompt)
        out.append(SimRequest(t, shared_prefix + prompt, output, 0 if shared_prefix else None, shared_prefix, n))
    return out


_REQUIRED = ("arrival", "prompt_len", "output_len")
_OPTIONAL = ("prefix_id", "prefix_len", "n")


def load_csv(path: str | Path, max_seq_len: int, default_prefix_len: int = 0) -> list[SimRequest]:
    """Requests from a CSV file with a header: arrival (seconds), prompt_len, output_len, and optionally
    prefix_id, prefix_len (default: default_prefix_len) and n. Rows are sorted by arrival."""
    path = Path(path)
    try:
        f = path.open(newline="")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from e
    with f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in (reader.fieldnames or [])]
        missing = [c for c in _REQUIRED if c not in header]
        if missing:
            raise TraceError(
                f"{path}: the header must name {', '.join(_REQUIRED)} (missing {', '.join(missing)}; "
                f"got {', '.join(header) or 'no header'})"
            )
        unknown = [h for h in header if h not in _REQUIRED + _OPTIONAL]
        if unknown:
            raise TraceError(
                f"{path}: unknown column(s) {', '.join(unknown)}; columns are {', '.join(_REQUIRED + _OPTIONAL)}"
            )
        out = []
        for line, row in enumerate(reader, start=2):
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k is not None}
            out.append(_parse_row(path, line, row, max_seq_len, default_prefix_len))
    if not out:
        raise TraceError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival)


def _parse_row(path: Path, line: int, row: dict, max_seq_len: int, default_prefix_len: int) -> SimRequest:
    def number(col: str, kind, default=None):
        text = row.get(col, "")
        if text == "":
            if default is not None or col not in _REQUIRED:
                return default
            raise TraceError(f"{path}:{line}: {col} is empty")
        try:
            return kind(text)
        except ValueError:
            raise TraceError(
                f"{path}:{line}: {col} must be {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None

    arrival = number("arrival", float)
    prompt_len, output_len = number("prompt_len", int), number("output_len", int)
    prefix_id = number("prefix_id", int)
    prefix_len = number("prefix_len", int, default_prefix_len if prefix_id is not None else 0)
    n = number("n", int, 1)
    if not math.isfinite(arrival) or arrival < 0:
        raise TraceError(f"{path}:{line}: arrival must be a finite number >= 0, got {arrival}")
    if prompt_len <= 0 or output_len <= 0 or n <= 0:
        raise TraceError(f"{path}:{line}: prompt_len, output_len and n must be positive")
    if prompt_len + output_len > max_seq_len:
        raise TraceError(
            f"{path}:{line}: prompt_len + output_len = {prompt_len + output_len} exceeds max_seq_len "
            f"{max_seq_len} (raise --max-seq-len)"
        )
    if not 0 <= prefix_len <= prompt_len:
        raise TraceError(f"{path}:{line}: prefix_len {prefix_len} must lie in 0..prompt_len ({prompt_len})")
    return SimRequest(arrival, prompt_len, output_len, prefix_id, prefix_len, n)
