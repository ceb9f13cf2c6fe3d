"""The tests mirror the package: every test module lives in tests/<area>/, an area is a package of vpaged
(or "benchmarks", "project"), each area folder has its conftest.py, and every module holding GPU-marked tests
is a stage of scripts/gpu_check.sh (the one run that has a GPU)."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
PACKAGE = ROOT / "vpaged"
NOT_PACKAGES = {"benchmarks", "project"}  # the benchmark scripts, the repository as a whole


def area_folders() -> list[Path]:
    return sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))


def test_no_test_module_lies_outside_an_area_folder():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"move each into tests/<area>/ (the vpaged package it tests): {loose}"
    deeper = sorted(str(p.relative_to(TESTS)) for p in TESTS.glob("*/*/test_*.py") if "fake_cuda" not in p.parts)
    assert not deeper, f"areas are one folder deep: {deeper}"


def test_areas_mirror_the_package_and_have_a_conftest():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    areas = {p.name for p in area_folders()}
    assert areas - NOT_PACKAGES <= packages, (
        f"areas with no vpaged/<area>/ package: {sorted(areas - NOT_PACKAGES - packages)}"
    )
    assert {"memory", "kvcache", "ops", "hf", "serve", "cli", "project"} <= areas
    missing = sorted(p.name for p in area_folders() if not (p / "conftest.py").exists())
    assert not missing, f"area folders without a conftest.py: {missing}"


def test_test_module_names_are_unique_across_areas():
    # pytest imports test modules by name (rootdir-relative "prepend" mode, no __init__.py): two files of one
    # name in two areas would shadow each other.
    names = [p.name for p in TESTS.glob("*/test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_every_module_with_gpu_tests_is_a_gpu_check_stage():
    marked = {
        str(p.relative_to(ROOT))
        for p in TESTS.glob("*/test_*.py")
        if re.search(r"pytest\.mark\.gpu|mark\.gpu\b", p.read_text())
    }
    staged = set(re.findall(r"pytest_file (tests/\S+\.py)", (ROOT / "scripts" / "gpu_check.sh").read_text()))
    assert marked == staged, (sorted(marked - staged), sorted(staged - marked))
