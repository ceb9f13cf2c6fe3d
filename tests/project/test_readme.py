"""The README's usage example runs as written, and the error list of docs/errors.md is that of vpaged/errors.py."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ERRORS_PAGE = ROOT / "docs" / "errors.md"


def test_readme_usage_example_runs():
    text = README.read_text()
    usage = text.split("## Usage", 1)[1]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    cache = namespace["cache"]
    assert namespace["s"].live_tokens == 100
    assert namespace["out"].shape == (1, 8, 1, 64)
    assert cache._closed


def test_errors_page_names_every_error_class():
    import vpaged.errors as errors

    text = ERRORS_PAGE.read_text()
    paragraph = text.split("**Errors**", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(\w+(?:Error|Warning))`", paragraph))
    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, Warning | errors.VPagedError)
        and value is not errors.VPagedError
    }
    assert classes - named == set(), "errors.py classes missing from docs/errors.md"
    builtin = {"MemoryError"}  # named as a base class
    assert named - classes - builtin == set(), "docs/errors.md names classes errors.py does not define"


def test_readme_links_resolve():
    """Every relative link of the README and the docs pages names a file of the tree."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert missing == [], missing


def _resolve(dotted: str):
    """The object a dotted name written in the docs stands for: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_vpaged_name_in_the_docs_resolves():
    """A module or name the README or a docs page writes as `vpaged.x.y` is importable from there (so a module
    moved without its docs fails here)."""
    pytest.importorskip("transformers")
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    names = {name for page in pages for name in re.findall(r"`(vpaged(?:\.\w+)+)", page.read_text())}
    for page in pages:  # and the names code blocks import: `from vpaged.serve import LLM, SamplingParams`
        for module, imported in re.findall(r"^\s*from (vpaged[\w.]*) import ([\w, ]+)$", page.read_text(), re.M):
            names |= {f"{module}.{name.strip()}" for name in imported.split(",")}
    assert len(names) > 10
    unresolved = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            unresolved.append(f"{name}: {e}")
    assert unresolved == [], unresolved


def test_the_two_commands_are_the_ones_ci_runs():
    """The README's two commands exist, and CI (.ci/run) runs its test command as written."""
    block = re.search(r"## Two commands\n.*?```bash\n(.*?)```", README.read_text(), re.S).group(1)
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["./scripts/demo.sh", "./scripts/test.sh"]
    for command in commands:
        script = ROOT / command
        assert script.is_file() and script.stat().st_mode & 0o111, f"{command} is not an executable script"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "./scripts/test.sh" in [line.strip() for line in ci], ".ci/run does not run the README's test command"
