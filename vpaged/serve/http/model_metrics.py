"""GET /metrics of a server of several models: each model's Prometheus text (metrics.py) with the label
model="NAME" on every sample, merged into one exposition.

The text format wants all samples of a metric family together, under one HELP and one TYPE line, so the
merge groups by family, in the order the families first appear: `vpaged_running{model="a"}` and
`vpaged_running{model="b"}` are two series of one family. A family in `server_wide` (the HTTP request
counts: one Guard counts them for the whole server, so every model's text holds the same ones) is taken
once, from the first text, without a model label.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .metrics import escape_label


@dataclass
class _Family:
    source: str  # the model whose text named the family first (a server-wide family's samples come from it)
    meta: dict[str, str] = field(default_factory=dict)  # "HELP" / "TYPE" -> its line
    samples: list[str] = field(default_factory=list)


def sample_name(line: str) -> str:
    """The metric name of a sample line: `name{labels} value` or `name value`."""
    ends = [i for i in (line.find("{"), line.find(" ")) if i != -1]
    return line[: min(ends)] if ends else line


def with_label(line: str, label: str) -> str:
    """A sample line with `label` (`key="value"`, escaped) put first among its labels."""
    name = sample_name(line)
    rest = line[len(name) :]
    if rest.startswith("{}"):
        rest = rest[2:]
    if rest.startswith("{"):
        return f"{name}{{{label},{rest[1:]}"
    return f"{name}{{{label}}}{rest}"


def labelled_exposition(texts: dict[str, str], server_wide: tuple[str, ...] = ()) -> str:
    """One exposition of several models' texts ({model name: text}), each sample labelled with its model."""
    families: dict[str, _Family] = {}
    for model, text in texts.items():
        label = f'model="{escape_label(model)}"'
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)  # "#", HELP or TYPE, the name, the rest
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    families.setdefault(parts[2], _Family(model)).meta.setdefault(parts[1], line)
                continue  # other comments say nothing a scraper reads
            name = sample_name(line)
            family = families.setdefault(name, _Family(model))
            if name not in server_wide:
                family.samples.append(with_label(line, label))
            elif family.source == model:
                family.samples.append(line)
    lines = []
    for family in families.values():
        lines += [family.meta[kind] for kind in ("HELP", "TYPE") if kind in family.meta]
        lines += family.samples
    return "\n".join(lines) + "\n"
