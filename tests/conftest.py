"""Fixtures every area of the tests shares; each area's own are in tests/<area>/conftest.py."""

import os
import random
import uuid

import pytest
import torch
from server_process import ServerProcess


@pytest.fixture
def rng():
    """A fresh random generator per test, seeded from the OS: every run checks new data."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed}")  # shown by pytest on failure, to replay a case
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def prng(rng):
    """A Python random.Random seeded from rng (shown on failure like rng's seed)."""
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))


@pytest.fixture
def budget_name(request):
    """A fresh machine-wide budget name (named after the test's area); the budget is removed afterwards, members
    or not (`vpaged budget remove NAME --force`)."""
    from vpaged.memory import SharedBudget

    name = f"test-{request.path.parent.name}-{uuid.uuid4().hex[:12]}"
    yield name
    SharedBudget.remove(name, force=True)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread: on a loaded machine OpenMP threads waiting on each other make tiny models many
    times slower, and nothing in the tests measures speed. Autouse for every module of tests/serve and
    tests/cli (their conftest.py); other modules ask for it by name."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def server_process():
    """Start `vpaged serve` processes: server_process(args, env=None) -> ServerProcess (tests/server_process.py);
    any still running when the test ends is killed."""
    started: list[ServerProcess] = []

    def start(args: list[str], env: dict | None = None) -> ServerProcess:
        started.append(ServerProcess(args, env))
        return started[-1]

    yield start
    for server in started:
        server.kill()


def pytest_collection_modifyitems(config, items):
    """Tests marked `serving` (the engine and its server) are skipped, with transformers' reason, where the
    installed transformers cannot serve (vpaged.hf.compat.serving_support): the check lives here once."""
    marked = [item for item in items if item.get_closest_marker("serving")]
    if not marked:
        return
    from vpaged.hf.compat import serving_support

    ok, why = serving_support()
    if not ok:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=why))
