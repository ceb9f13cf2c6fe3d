"""docs/numbers.md is what `python -m vpaged.cli.numbers` generates from benchmarks/results/*.json, and every
measured figure quoted elsewhere in the README or docs/ has a results file behind it.

The convention the figure tests enforce: a paragraph (or a table together with the paragraph that
introduces it) that quotes a measured figure (a ratio such as 0.91x or 1.8×, a tok/s or GB/s rate, a time in
µs or ms, a percentage) names the results file it comes from, `benchmarks/results/NAME.json`, and that file
exists (archive/ does not count). The README quotes no figure at all: it links to docs/numbers.md.
"""

import re
from pathlib import Path

from vpaged.cli import numbers

ROOT = Path(__file__).resolve().parents[2]
FIGURE = re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)?(?:(?:×|x)(?![\w])|\s?(?:tok/s|tokens/s|GB/s|MB/s|µs|ms\b|%))")
RESULTS_REF = re.compile(r"benchmarks/results/((?!archive/)[\w./+-]+\.json)|(?<![/\w])([\w.+-]+_[\w.+-]+\.json)\b")
FENCE = re.compile(r"```.*?```", re.S)


def _units(text: str) -> list[str]:
    """Paragraphs outside code blocks; a table is joined to the paragraph just before it (its caption)."""
    blocks = [b for b in re.split(r"\n\s*\n", FENCE.sub("", text)) if b.strip()]
    units: list[str] = []
    for block in blocks:
        if block.lstrip().startswith("|") and units:
            units[-1] += "\n" + block
        else:
            units.append(block)
    return units


def unbacked_figures(text: str, results: Path = numbers.RESULTS) -> list[str]:
    """The figures of `text` whose paragraph names no existing results file, and cited files that are missing."""
    problems = []
    for unit in _units(text):
        cited = {a or b for a, b in RESULTS_REF.findall(unit)}
        missing = sorted(name for name in cited if not (results / name).is_file())
        problems += [f"cites a missing results file: {name}" for name in missing]
        figures = FIGURE.findall(unit)
        if figures and not cited - set(missing):
            problems.append(f"{figures[:3]} with no results file, in: {unit.strip()[:120]!r}")
    return problems


def test_numbers_page_is_generated_from_the_results():
    page = ROOT / "docs" / "numbers.md"
    assert page.read_text() == numbers.render(), "docs/numbers.md is stale: run python -m vpaged.cli.numbers"


def test_numbers_page_rows_name_machine_isa_date_and_file():
    files = numbers.results_files()
    assert files, "no results files"
    text = numbers.render()
    for path in files:
        assert f"[{path.name}](../benchmarks/results/{path.name})" in text, f"{path.name} not accounted for"
    for line in text.splitlines():
        if line.startswith("| ") and "](../benchmarks/results/" in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert any(re.fullmatch(r"\d{4}-\d{2}-\d{2}|date unknown", c) for c in cells), line
            assert any(c in numbers._ISAS or c == "ISA unknown" for c in cells), line


def test_provenance_falls_back_to_the_file_name_tag(tmp_path):
    path = tmp_path / "serve_sweep_mb512_epyc-zen3-avx2-2c.json"
    prov = numbers.provenance(path, {"results": {}})
    assert (prov.machine, prov.isa, prov.date) == ("epyc-zen3-avx2-2c", "avx2", "date unknown")
    prov = numbers.provenance(tmp_path / "x_epyc-2c.json", {"machine": {"date": "2026-12-01T10:00:00+00:00"}})
    assert (prov.isa, prov.date) == ("ISA unknown", "2026-12-01")


def test_readme_quotes_no_figure():
    text = (ROOT / "README.md").read_text()
    figures = [f for unit in _units(text) for f in FIGURE.findall(unit)]
    assert figures == [], f"README figures belong in docs/numbers.md: {figures}"


def test_every_docs_figure_has_a_results_file():
    problems = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name == "numbers.md":
            continue
        problems += [f"docs/{page.name}: {p}" for p in unbacked_figures(page.read_text())]
    assert problems == [], "\n".join(problems)


def test_the_figure_check_catches_unbacked_and_missing_files():
    existing = numbers.results_files()[0].name
    assert unbacked_figures("p99 came to 0.91x of the static split.\n")
    assert unbacked_figures("| row | tok/s |\n| --- | --- |\n| a | 151.8 tok/s |\n")
    assert unbacked_figures("it ran at 1.8× (`benchmarks/results/no_such-run_epyc-2c.json`).\n")
    assert unbacked_figures(f"ran at 1.8× (`benchmarks/results/{existing}`).\n") == []
    assert unbacked_figures(f"Caption (`benchmarks/results/{existing}`):\n\n| a |\n| --- |\n| 2.5x |\n") == []
    assert unbacked_figures("a 4 x 64 head grid, 8 layers × 8 heads, transformers 5.x\n") == []
    assert unbacked_figures("one call takes 19 µs\n")
    assert unbacked_figures(f"1.8× (`benchmarks/results/archive/{existing}`)\n")  # archive/ backs nothing
