"""`vpaged budget create | show | limit | remove` against a real segment and a member pool."""

import json
import time
import uuid

import pytest

from vpaged import PagePool
from vpaged.cli.budget import parse_bytes
from vpaged.cli.main import main
from vpaged.memory import SharedBudget

PAGE = 64 * 1024


@pytest.fixture
def budget_name():
    name = f"cli-{uuid.uuid4().hex[:12]}"
    yield name
    SharedBudget.remove(name, force=True)


def test_parse_bytes():
    assert parse_bytes("1048576") == 2**20
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("4G") == 4 * 2**30 and parse_bytes("1.5gb") == 3 * 2**29
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_create_show_limit_remove(budget_name, capsys):
    assert main(["budget", "create", budget_name, "--bytes", "4MiB"]) == 0
    assert "4.0 MiB" in capsys.readouterr().out
    assert main(["budget", "create", budget_name, "--bytes", "4MiB"]) == 1
    assert "vpaged budget remove" in capsys.readouterr().err
    pool = PagePool("cpu", capacity_bytes=4 << 20, shared_budget=budget_name, member_name="engine-a", model="m1")
    assert pool.ensure_free(20)
    assert main(["budget", "show", budget_name, "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert state["capacity_bytes"] == 4 << 20 and len(state["members"]) == 1
    m = state["members"][0]
    assert (m["name"], m["model"], m["ceiling_bytes"]) == ("engine-a", "m1", 4 << 20)
    assert m["granted_bytes"] >= 20 * PAGE and state["free_bytes"] == (4 << 20) - m["granted_bytes"]
    assert main(["budget", "show", budget_name]) == 0
    assert "engine-a" in capsys.readouterr().out
    assert main(["budget", "limit", budget_name, "--member", "engine-a", "--max", str(10 * PAGE)]) == 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and SharedBudget.open(budget_name).state().members[0].granted_bytes > 10 * PAGE:
        time.sleep(0.02)
    assert SharedBudget.open(budget_name).state().members[0].granted_bytes <= 10 * PAGE  # nothing was in use
    assert pool.free_pages() <= 10
    assert main(["budget", "limit", budget_name, "--member", "nobody", "--max", "1MiB"]) == 1
    assert main(["budget", "remove", budget_name]) == 0
    assert main(["budget", "remove", budget_name]) == 1
    assert main(["budget", "show", budget_name]) == 1
    assert "vpaged budget create" in capsys.readouterr().err
