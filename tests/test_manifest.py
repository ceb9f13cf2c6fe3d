"""tests/manifest.toml is complete and true: every test file is in exactly one area, and the run lists hold."""

import re
from collections import Counter
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading tests/manifest.toml on Python 3.10 needs tomli")

TESTS = Path(__file__).parent
MANIFEST = tomllib.loads((TESTS / "manifest.toml").read_text())
PACKAGE = TESTS.parent / "vpaged"


def test_every_test_file_is_in_exactly_one_area():
    listed = Counter(name for files in MANIFEST["areas"].values() for name in files)
    on_disk = {p.name for p in TESTS.glob("test_*.py")}
    twice = sorted(name for name, n in listed.items() if n > 1)
    missing = sorted(on_disk - set(listed))
    stale = sorted(set(listed) - on_disk)
    assert not twice, f"in more than one area of tests/manifest.toml: {twice}"
    assert not missing, f"not in tests/manifest.toml (add each to the area it tests): {missing}"
    assert not stale, f"listed in tests/manifest.toml but not in tests/: {stale}"


def test_areas_mirror_the_package():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    areas = set(MANIFEST["areas"]) - {"project", "benchmarks"}
    assert areas <= folders, f"areas with no vpaged/<area>/ package: {sorted(areas - folders)}"


def test_gpu_list_is_the_files_with_gpu_marked_tests():
    marked = {p.name for p in TESTS.glob("test_*.py") if re.search(r"pytest\.mark\.gpu|mark\.gpu\b", p.read_text())}
    assert set(MANIFEST["runs"]["gpu"]) == marked


def test_fake_driver_list_is_the_files_that_build_the_fake_driver():
    # The driver is built by test_cuda_backend_fake.py (FAKE_SOURCE); other files take its fixture from there.
    builds = re.compile(r"^FAKE_SOURCE = |^(from|import) test_cuda_backend_fake\b", re.M)
    using = {p.name for p in TESTS.glob("test_*.py") if builds.search(p.read_text())}
    assert set(MANIFEST["runs"]["fake_driver"]) == using
