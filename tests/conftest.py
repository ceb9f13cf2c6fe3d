"""Fixtures every area of the tests shares; each area's own are in tests/<area>/conftest.py."""

import os

import pytest
import torch


@pytest.fixture
def rng():
    """A fresh random generator per test, seeded from the OS: every run checks new data."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed}")  # shown by pytest on failure, to replay a case
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread: on a loaded machine OpenMP threads waiting on each other make tiny models many
    times slower, and nothing in the tests measures speed. Autouse for every module of tests/serve and
    tests/cli (their conftest.py); other modules ask for it by name."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
