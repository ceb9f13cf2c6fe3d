"""Sealed boundaries: no module of vpaged reaches into another module's private names.

A name starting with one underscore is private to the module that defines it: other modules use public
methods (PagePool.incref, PagePool.register, ...) instead. Checked on the source: every `obj._name` where obj
is not self/cls, and every `from .module import _name`, must name something the same module defines.
Private modules (vpaged._C, vpaged.kvcache.checks, vpaged.memory.dtypes) are package-internal and may be imported.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vpaged"
MODULES = sorted(PACKAGE.rglob("*.py"))
PRIVATE_MODULES = {"_C"}
# Private names of other libraries that vpaged must use, each with the reason.
THIRD_PARTY = {
    "_global_mapping": "transformers' AttentionInterface registry has no public way to unregister a function",
    "_attn_implementation": "transformers' config records the attention implementation a model runs there",
    "_foreach_copy_": "torch's multi-tensor copy: one call writes a step's K/V into every layer",
    "_reorder_linear_weight": "torch's oneDNN weight packing (inductor's freezing pass emits it); hf/prepack.py",
    "_linear_pointwise": "torch's oneDNN matmul on a packed weight (inductor's freezing pass emits it); hf/prepack.py",
    "_version": "torch's version counter of a tensor: hf/prepack.py repacks a weight changed in place",
    "_maybe_evict_cached_block": "vLLM 0.32's BlockPool: the only call that drops a free block's prefix-cache "
    "entry (integrations/vllm/budget.py gives back the pages of blocks kept only as prefix cache)",
    "_TP": "vLLM's tensor-parallel group, None before it is set up: the public getter asserts instead "
    "(integrations/vllm/patches.py declines TP > 1)",
    "_PP": "vLLM's pipeline-parallel group, read as _TP is (integrations/vllm/patches.py declines PP > 1)",
}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assigned names and attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return {n for n in names if private(n)}


def foreign_private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    own = defined_names(tree) | PRIVATE_MODULES
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if node.attr not in own and node.attr not in THIRD_PARTY:
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if private(alias.name) and alias.name not in PRIVATE_MODULES:
                    found.append(f"{path.name}:{node.lineno}: import {alias.name}")
    return sorted(found)


def test_the_package_has_modules_to_check():
    assert {"cache.py", "pool.py", "slot_table.py", "prefix.py", "plans.py"} <= {p.name for p in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_no_module_touches_another_modules_private_names(path):
    assert foreign_private_uses(path) == []


def test_the_check_finds_a_reach_into_another_module(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(cache, pool):\n    cache._check_layer(0)\n    return pool._pool.incref(1)\n"
        "from .pool import _default_pools\n"
    )
    assert sorted(foreign_private_uses(bad)) == [
        "bad.py:2: ._check_layer",
        "bad.py:3: ._pool",
        "bad.py:4: import _default_pools",
    ]
    good = tmp_path / "good.py"
    good.write_text(
        "class A:\n    def __init__(self):\n        self._x = 1\n\n    def same(self, other):\n"
        "        return other._x + self._x\n"
    )
    assert foreign_private_uses(good) == []
