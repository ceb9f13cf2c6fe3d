"""Every repository path README.md, docs/*.md and benchmarks/NOTES.md mention exists.

A path is a mention starting with one of the top-level folders below (`benchmarks/results/x.json`,
`vpaged/ops/`, `scripts/gpu_check.sh`), backticked or plain. Trailing punctuation is not part of it, nor is a
`::test` suffix; a folder may end in `/`. Mentions with a glob or a placeholder (`csrc/page_pool.*`,
`benchmarks/results/gpu-<date>`) are skipped. In plain text a mention without an extension or a trailing `/`
is skipped too: there `vpaged/paged` is a ratio, not a path. NOTES.md lives in benchmarks/ and also names
result files as `results/...`, which are looked up under benchmarks/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("benchmarks", "vpaged", "csrc", "scripts", "tests", "examples")
DOCS = {
    "README.md": {},
    "benchmarks/NOTES.md": {"results": "benchmarks/results"},
    # The docs pages name repository paths from the root too (and link to them with ../).
    **{str(p.relative_to(ROOT)): {} for p in sorted((ROOT / "docs").glob("*.md"))},
}

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`[^`]+`")
_GLOB = set("*?<>{}[]")


def _mention(prefixes: tuple[str, ...]) -> re.Pattern[str]:
    names = "|".join(re.escape(p) for p in prefixes)
    # Not preceded by a path or word character, so $ROOT/benchmarks/..., kv=vpaged/... and x/tests/... don't count.
    return re.compile(rf"(?<![\w./=$-])((?:{names})/[\w./*?<>{{}}\[\]-]*)")


def _pieces(text: str) -> list[tuple[str, bool]]:
    """The text cut into (piece, is_code): fenced blocks and backticked spans are code."""
    pieces: list[tuple[str, bool]] = []
    rest = 0
    for fence in _FENCE.finditer(text):
        pieces += _spans(text[rest : fence.start()])
        pieces.append((fence.group(0), True))
        rest = fence.end()
    return pieces + _spans(text[rest:])


def _spans(text: str) -> list[tuple[str, bool]]:
    pieces: list[tuple[str, bool]] = []
    rest = 0
    for span in _SPAN.finditer(text):
        pieces.append((text[rest : span.start()], False))
        pieces.append((span.group(0), True))
        rest = span.end()
    pieces.append((text[rest:], False))
    return pieces


def mentioned_paths(text: str, relative: dict[str, str] | None = None) -> set[str]:
    """Repository paths a document mentions, as written (relative prefixes mapped through `relative`)."""
    relative = relative or {}
    pattern = _mention(TOP + tuple(relative))
    found: set[str] = set()
    for piece, code in _pieces(text):
        for m in pattern.finditer(piece):
            path = m.group(1).rstrip(".")
            if _GLOB & set(path):
                continue
            last = path.rstrip("/").rsplit("/", 1)[-1]
            if not code and not path.endswith("/") and "." not in last:
                continue
            head, _, tail = path.partition("/")
            if head in relative:
                path = f"{relative[head]}/{tail}"
            found.add(path)
    return found


def missing_paths(doc: str) -> list[str]:
    text = (ROOT / doc).read_text()
    return sorted(p for p in mentioned_paths(text, DOCS[doc]) if not (ROOT / p).exists())


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_paths_in_docs_exist(doc):
    missing = missing_paths(doc)
    assert not missing, f"{doc} mentions paths that do not exist: {missing}"


def test_mentions_are_read_as_paths():
    text = (
        "see `vpaged/ops/decode.py`, benchmarks/results/x.json. and (scripts/a.sh), tests/t.py::test_x;\n"
        "folders csrc/kernels/ and `vpaged/serve`; globs csrc/page_pool.* and benchmarks/results/gpu-<date>;\n"
        "ratios vpaged/paged 0.91, kv=vpaged/x.py; $ROOT/benchmarks/y.json; results/z.json\n"
        "```bash\npython examples/run.py\n```\n"
    )
    assert mentioned_paths(text, {"results": "benchmarks/results"}) == {
        "vpaged/ops/decode.py",
        "benchmarks/results/x.json",
        "scripts/a.sh",
        "tests/t.py",
        "csrc/kernels/",
        "vpaged/serve",
        "benchmarks/results/z.json",
        "examples/run.py",
    }
    assert mentioned_paths("results/z.json") == set()
