"""The Prometheus exposition text of GET /metrics: the engine's stats() and the HTTP request counts.

The request counts are labelled by route template (guard.route_label: the known routes, every other path
"other"), so clients cannot grow the number of series, and label values are escaped as the format asks."""

from __future__ import annotations

from collections import Counter
from dataclasses import fields, is_dataclass

# EngineStats fields that only ever grow (Prometheus counters); every other numeric field is a gauge.
_COUNTERS = {
    "prefix_hit_tokens",
    "preemptions_swap",
    "preemptions_recompute",
    "requests_finished",
    "prompt_tokens_total",
    "generation_tokens_total",
    "steps",
    "requests_aborted",
    "requests_added",
}


def _stats_items(stats) -> list[tuple[str, float]]:
    if is_dataclass(stats):
        items = [(f.name, getattr(stats, f.name)) for f in fields(stats)]
    else:
        items = list(vars(stats).items())
    return [(k, float(v)) for k, v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]


def shared_budget_lines(figures) -> list[str]:
    """A machine-wide shared budget's totals and this server's figures as a member (EngineStats.shared_budget,
    a vpaged.memory.BudgetFigures), gauges `vpaged_shared_budget_<field>{budget="NAME"}`, and its share
    policy as an info metric."""
    label = f'budget="{escape_label(figures.name)}"'
    lines = [
        "# HELP vpaged_shared_budget_info the shared budget this engine is a member of, and its share policy",
        "# TYPE vpaged_shared_budget_info gauge",
        f'vpaged_shared_budget_info{{{label},share_policy="{escape_label(figures.share_policy)}"}} 1.0',
    ]
    for name, value in _stats_items(figures):
        metric = f"vpaged_shared_budget_{name}"
        lines += [f"# HELP {metric} LLMEngine.stats().shared_budget.{name}", f"# TYPE {metric} gauge"]
        lines.append(f"{metric}{{{label}}} {value!r}")
    if not getattr(figures, "ok", 1):  # removed, replaced, damaged, or waiting on a member (budget_health.py)
        cause = f'kind="{escape_label(figures.problem_kind)}",reason="{escape_label(figures.problem)}"'
        lines += [
            "# HELP vpaged_shared_budget_problem_info why the shared budget is not ok (vpaged_shared_budget_ok 0)",
            "# TYPE vpaged_shared_budget_problem_info gauge",
            f"vpaged_shared_budget_problem_info{{{label},{cause}}} 1.0",
        ]
    return lines


def escape_label(value) -> str:
    """A label value as the Prometheus text format writes it: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(
    stats, http_counts: Counter, extra: dict[str, float] | None = None, failure: str | None = None
) -> str:
    """The Prometheus exposition text: one metric per numeric field of the engine's stats, `vpaged_<field>`.
    `failure`: why the engine cannot serve (then stats may be None: a broken tensor-parallel engine cannot
    gather its ranks' stats), reported as vpaged_engine_up 0 and vpaged_engine_failure_info{reason}."""
    lines = [
        "# HELP vpaged_engine_up 1 while the engine serves, 0 once it cannot (see vpaged_engine_failure_info)",
        "# TYPE vpaged_engine_up gauge",
        f"vpaged_engine_up {0.0 if failure is not None else 1.0!r}",
    ]
    if failure is not None:
        lines += [
            "# HELP vpaged_engine_failure_info why the engine cannot serve (e.g. the tensor-parallel rank lost)",
            "# TYPE vpaged_engine_failure_info gauge",
            f'vpaged_engine_failure_info{{reason="{escape_label(failure)}"}} 1.0',
        ]
    for name, value in _stats_items(stats) if stats is not None else []:
        metric = f"vpaged_{name}"
        kind = "counter" if name in _COUNTERS or name.endswith("_total") or name.startswith("time_") else "gauge"
        lines += [f"# HELP {metric} LLMEngine.stats().{name}", f"# TYPE {metric} {kind}", f"{metric} {value!r}"]
    for name, value in (extra or {}).items():
        lines += [f"# TYPE vpaged_{name} counter", f"vpaged_{name} {float(value)!r}"]
    ranks = getattr(stats, "ranks", ()) or ()
    for name in [f.name for f in fields(ranks[0])] if ranks else []:  # tensor parallel: each rank's KV store
        metric = f"vpaged_rank_{name}"
        kind = "counter" if name in _COUNTERS else "gauge"
        lines += [f"# HELP {metric} LLMEngine.stats().ranks[rank].{name}", f"# TYPE {metric} {kind}"]
        lines += [f'{metric}{{rank="{r}"}} {float(getattr(m, name))!r}' for r, m in enumerate(ranks)]
    budget = getattr(stats, "shared_budget", None)
    if budget is not None:
        lines += shared_budget_lines(budget)
    state = getattr(stats, "prefix_caching", None)
    if isinstance(state, str):  # an info metric: whether prefix caching is on, and why not when it is off
        on = state == "on"
        labels = f'state="{"on" if on else "off"}",reason="{escape_label("" if on else state)}"'
        lines += [
            "# HELP vpaged_prefix_caching_info prefix caching on or off (LLMEngine.stats().prefix_caching)",
            "# TYPE vpaged_prefix_caching_info gauge",
            f"vpaged_prefix_caching_info{{{labels}}} 1.0",
        ]
    lines += [
        "# HELP vpaged_http_requests_total HTTP requests by path and status",
        "# TYPE vpaged_http_requests_total counter",
    ]
    for (path, status), count in sorted(http_counts.items()):
        labels = f'path="{escape_label(path)}",status="{escape_label(status)}"'
        lines.append(f"vpaged_http_requests_total{{{labels}}} {float(count)!r}")
    return "\n".join(lines) + "\n"
