"""Reports of a simulation: a table per cache kind, JSON, and PNG plots (matplotlib, the `plot` extra)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidArgumentError

GiB = 1 << 30


def table_rows(summaries: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = [
        "cache kind",
        "live",
        "waste",
        "(fragment.",
        "reserved)",
        "dormant¹",
        "peak held",
        "peak reqs",
        "mean reqs",
        "finished",
        "preempt.",
        "steps",
    ]
    rows = []
    for s in summaries:
        rows.append(
            [
                s["policy"],  # the summary's key for the kind's name (kept from when kinds were "policies")
                f"{s['live_share']:.1%}",
                f"{s['waste_share']:.1%}",
                f"{s['fragmentation_share']:.1%}",
                f"{s['reserved_share']:.1%}",
                f"{s['dormant_share']:.1%}",
                f"{s['peak_held_bytes'] / GiB:.1f} GiB",
                str(s["peak_running"]),
                f"{s['mean_running']:.0f}",
                f"{s['finished']}" + (f" (+{s['dropped']} dropped)" if s["dropped"] else ""),
                str(s["preemptions"]),
                str(s["steps"]),
            ]
        )
    return headers, rows


NOTE = (
    "live / waste: shares of the memory held for live sequences (waste = fragmentation + reservation); "
    "¹dormant: share of all held memory kept only for reuse (freed slots, prefix cache), reclaimable at once"
)


def print_table(title: str, summaries: list[dict]) -> None:
    headers, rows = table_rows(summaries)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        print(NOTE)
        return
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    console = Console(width=200)
    console.print(table)
    console.print(NOTE)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def plot(results, out_dir: Path, title: str) -> list[Path]:
    """memory_over_time.png (held and stored bytes per cache kind) and waste_by_cause.png (shares of held
    memory per cache kind). Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InvalidArgumentError("plots need matplotlib: pip install 'vpaged[plot]' (or run without --plot)") from e
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for r in results:
        steps = [s.step for s in r.samples]
        (line,) = ax.plot(steps, [s.breakdown.held_bytes / GiB for s in r.samples], label=f"{r.kind} held")
        ax.plot(steps, [s.breakdown.stored_bytes / GiB for s in r.samples], linestyle=":", color=line.get_color())
    ax.set_xlabel("decode step")
    ax.set_ylabel("GiB (solid: held by the cache, dotted: live tokens)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / "memory_over_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    summaries = [r.summary() for r in results]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    names = [s["policy"] for s in summaries]
    bottom = [0.0] * len(names)
    for key, label, color in (
        ("stored_bytes", "live tokens", "#4c9a2a"),
        ("fragmentation_bytes", "fragmentation", "#d1495b"),
        ("reserved_bytes", "reserved (static)", "#edae49"),
        ("dormant_bytes", "dormant (reclaimable)", "#66a3d2"),
    ):
        vals = [s["held_composition"][key] * 100 for s in summaries]
        ax.barh(names, vals, left=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("% of memory held by the cache (over the run)")
    ax.set_title(title)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    paths.append(out_dir / "waste_by_cause.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
