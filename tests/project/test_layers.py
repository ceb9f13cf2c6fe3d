"""The package's layers, checked on the source: imports follow the layers, form no circle, and reach the
parts of a VirtualKVCache only through its package; and every module imports on its own.

The layers, lowest first (a module may import its own layer and the ones below it, never above):

    errors, _C, lazy                  (0)  every layer may use them
    memory/                           (1)  pages, pools, devices, the torch allocator
    kvcache/  (and kvcache/virtual/)  (2)  the caches on a pool
    ops/                              (3)  kernels over the caches
    hf/                               (4)  transformers integration
    serve/                            (5)  the serving engine and its HTTP server
    sim/                              (6)  the simulator
    integrations/                     (6)  vpaged under other engines (vLLM, imported lazily)
    cli/                              (7)  the `vpaged` command

`vpaged/__init__.py` is the package face: it re-exports names of memory, kvcache, ops and errors, and no
module of the package imports it except the command (cli/), which reads the version there as a user would.
Imports inside functions (deferred) count like any other, and so do imports under `if TYPE_CHECKING:`, for
the layers and for circles alike: a type-only import still ties two modules together (a reader, a type checker
and every refactoring must take both). A module that would close a circle only to name a type declares what
it uses as a Protocol of its own instead (memory/budget/member.py's GrantedPool, which the pool satisfies
without being imported).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vpaged"
LAYERS = {
    "errors": 0,
    "lazy": 0,
    "_C": 0,
    "memory": 1,
    "kvcache": 2,
    "ops": 3,
    "hf": 4,
    "serve": 5,
    "sim": 6,
    "integrations": 6,
    "cli": 7,
}
VIRTUAL = "vpaged.kvcache.virtual"
# Parts of a VirtualKVCache that others of its parts may import at run time: plain shapes and tables that
# hold no reference to another part. Everything else in virtual/ is wired together by cache.py alone.
VIRTUAL_LEAVES = {f"{VIRTUAL}.layout", f"{VIRTUAL}.slot_table"}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        found.add(id(sub))
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported vpaged module, line, runs) for every import in the module, top level or deferred; `runs`
    is False for imports under TYPE_CHECKING. `from pkg import sub` names the submodule when there is one."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = []
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                targets.append(sub if sub in modules or sub == "vpaged._C" else mod)
        else:
            continue
        for t in targets:
            if t == "vpaged" or t.startswith("vpaged."):
                out.append((t, node.lineno, id(node) not in typing_only))
    return out


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package face
    return LAYERS.get(parts[1])


def layer_violations(package: Path = PACKAGE) -> list[str]:
    modules = all_modules(package)
    bad = []
    for name, path in modules.items():
        mine = layer_of(name)
        for target, line, _ in imports_of(name, path, modules):
            where = f"{name}:{line} imports {target}"
            if target == "vpaged":
                if mine != LAYERS["cli"]:  # the command reports the package's version, as a user would
                    bad.append(f"{where}: the package face is for users, not for the package's own modules")
                continue
            theirs = layer_of(target)
            if theirs is None:
                bad.append(f"{where}: not a module of a known layer")
            elif mine is not None and theirs > mine:
                bad.append(f"{where}: layer {theirs} above the importer's layer {mine}")
            elif name == "vpaged" and theirs > LAYERS["ops"]:
                bad.append(f"{where}: the package face re-exports memory, kvcache, ops and errors only")
    return bad


def virtual_violations(package: Path = PACKAGE) -> list[str]:
    modules = all_modules(package)
    bad = []
    for name, path in modules.items():
        inside = name == VIRTUAL or name.startswith(VIRTUAL + ".")
        for target, line, runs in imports_of(name, path, modules):
            if not target.startswith(VIRTUAL + ".") or target == name:
                continue
            if not inside:
                bad.append(f"{name}:{line} imports {target}: outside {VIRTUAL}, use the package's faces")
            elif runs and name not in (VIRTUAL, f"{VIRTUAL}.cache") and target not in VIRTUAL_LEAVES:
                bad.append(f"{name}:{line} imports {target}: only cache.py wires the parts of a VirtualKVCache")
    return bad


def import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Circles in the graph of all imports (top level, deferred and type-only), one per strongly connected set."""
    modules = all_modules(package)
    graph = {
        name: sorted({t for t, _, _ in imports_of(name, path, modules) if t in modules and t != name})
        for name, path in modules.items()
    }
    # Parent packages run on every import of a submodule; that edge is Python's, not the code's choice.
    for name in graph:
        graph[name] = [t for t in graph[name] if not name.startswith(t + ".")]
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_the_layers_are_folders():
    modules = all_modules()
    for layer in ("memory", "kvcache", "kvcache.virtual", "ops", "hf", "serve", "sim", "cli"):
        assert f"vpaged.{layer}" in modules, layer
    top = {p.name for p in PACKAGE.iterdir() if p.suffix in (".py", ".pyi")}
    assert top == {"__init__.py", "errors.py", "lazy.py", "_C.pyi"}, (
        "the top level holds the package face, errors, the lazy-name loader and stubs"
    )


def test_imports_follow_the_layers():
    assert layer_violations() == []


def test_the_parts_of_a_virtual_cache_are_reached_through_its_package():
    assert virtual_violations() == []


def test_no_import_circle():
    assert import_cycles() == []


BUDGET = "vpaged.memory.budget"


def test_the_budget_sees_its_pool_through_a_protocol():
    """The shared budget is a package of its own under memory/: its modules import one another, errors and the
    extension, never the rest of memory/ (the pool imports the budget; the budget knows the pool only as the
    GrantedPool protocol), not even for a type."""
    modules = all_modules()
    budget = sorted(n for n in modules if n == BUDGET or n.startswith(BUDGET + "."))
    assert {f"{BUDGET}.{m}" for m in ("segment", "ledger", "liveness", "member", "health", "shared", "policy")} < set(
        budget
    )
    bad = [
        f"{name}:{line} imports {target}"
        for name in budget
        for target, line, _ in imports_of(name, modules[name], modules)
        if target.startswith("vpaged.memory") and not (target == BUDGET or target.startswith(BUDGET + "."))
    ]
    assert bad == []


def test_the_checks_find_what_they_look_for(tmp_path):
    pkg = tmp_path / "vpaged"
    for sub in ("memory", "kvcache", "kvcache/virtual", "ops"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    # a circle through a deferred import, and a record of the cache layer that imports the kernel layer
    (pkg / "kvcache" / "records.py").write_text("def f():\n    from ..ops import kernel\n")
    (pkg / "ops" / "kernel.py").write_text("from ..kvcache.virtual import cache\n")
    (pkg / "kvcache" / "virtual" / "cache.py").write_text("from ..records import f\n")
    # memory importing upward; an outsider and a part reaching into virtual/ internals
    (pkg / "memory" / "pool.py").write_text("from ..kvcache.virtual.layout import Layout\nimport vpaged\n")
    (pkg / "kvcache" / "virtual" / "layout.py").write_text("")
    (pkg / "kvcache" / "virtual" / "prefix.py").write_text("from .swap import Swap\n")
    (pkg / "kvcache" / "virtual" / "swap.py").write_text("")
    # a circle closed only by an import for a type: memory/grant.py names the pool's type under TYPE_CHECKING
    (pkg / "memory" / "grant.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .holder import Holder\n"
    )
    (pkg / "memory" / "holder.py").write_text("from .grant import x\n")
    assert sorted(import_cycles(pkg)) == [
        ["vpaged.kvcache.records", "vpaged.kvcache.virtual.cache", "vpaged.ops.kernel"],
        ["vpaged.memory.grant", "vpaged.memory.holder"],
    ]
    assert sorted(v.split(":")[0] for v in layer_violations(pkg)) == [
        "vpaged.kvcache.records",
        "vpaged.memory.pool",
        "vpaged.memory.pool",
    ]
    assert sorted(v.split(" imports ")[0] for v in virtual_violations(pkg)) == [
        "vpaged.kvcache.virtual.prefix:1",
        "vpaged.memory.pool:1",
        "vpaged.ops.kernel:1",
    ]


# Each module imported with no other module of vpaged loaded (the extension and third-party packages stay,
# so that one interpreter serves them all): a module that works only after another one was imported first
# fails here.
IMPORT_EACH = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if (m == "vpaged" or m.startswith("vpaged.")) and m != "vpaged._C"]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


VLLM_CONNECTOR = "vpaged.integrations.vllm.connector."


def test_every_module_imports_on_its_own():
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    names = sorted(n for n in all_modules() if not n.endswith(".__main__"))  # __main__ runs the command
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *names], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    failed = [line for line in done.stdout.splitlines() if line.strip()]
    if importlib.util.find_spec("vllm") is None:
        # The vLLM connector's modules subclass vLLM's classes: they import only where vLLM is (test_vllm.sh).
        failed = [
            f for f in failed
            if not (f.startswith(VLLM_CONNECTOR) and f.endswith("No module named 'vllm'"))
        ]  # fmt: skip
    assert failed == [] and (done.returncode == 0 or done.stdout.strip()), done.stdout + done.stderr[-3000:]
