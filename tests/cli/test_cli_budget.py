"""`vpaged budget create | show | limit | remove` against a real segment and a member pool."""

import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import vpaged
from vpaged import PagePool
from vpaged.cli.budget import check_name, parse_bytes
from vpaged.cli.main import main
from vpaged.errors import InvalidArgumentError
from vpaged.memory import SharedBudget
from vpaged.memory.budget.segment import segment_path

PAGE = 64 * 1024


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
    assert main(["budget", "remove", budget_name]) == 1  # engine-a is in it
    assert main(["budget", "remove", budget_name, "--force"]) == 0
    assert main(["budget", "remove", budget_name]) == 1
    assert main(["budget", "show", budget_name]) == 1
    assert "vpaged budget create" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- errors
ROOT = str(Path(vpaged.__file__).resolve().parents[1])  # the vpaged these tests import, in subprocesses too


def one_line_error(capsys, argv) -> str:
    """Run `vpaged ARGV`: exit status 1, exactly one line on stderr, no traceback; returns that line."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("vpaged budget: ")
    return err


def cli(*argv: str, user: int | None = None) -> subprocess.CompletedProcess:
    """`python -m vpaged.cli budget ARGV` in a process of its own (as uid `user` when given)."""
    cmd = [sys.executable, "-m", "vpaged.cli", "budget", *argv]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    env = {**os.environ, "PYTHONPATH": ROOT, "HOME": "/tmp"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd="/tmp")


def test_create_refuses_a_name_with_a_trailing_newline(capsys):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    before = set(os.listdir("/dev/shm"))
    for bad in (name + "\n", name + "\r\n", "\n" + name, name + "/x", "", "x" * 65):
        assert repr(bad) in one_line_error(capsys, ["budget", "create", bad, "--bytes", "4MiB"])
    assert set(os.listdir("/dev/shm")) == before  # nothing made
    with pytest.raises(InvalidArgumentError):
        check_name(name + "\n")
    assert check_name("x" * 64) == "x" * 64


@pytest.mark.parametrize("size", ["1e400", "inf", "nan", "-5", "-1KiB", "1e30GiB", "5XB", "", "0x10"])
def test_create_refuses_a_size_that_is_not_one(capsys, budget_name, size):
    assert "not a size" in one_line_error(capsys, ["budget", "create", budget_name, f"--bytes={size}"])
    assert not os.path.exists(segment_path(budget_name))
    with pytest.raises(ValueError):  # InvalidArgumentError is one
        parse_bytes(size)


def test_create_refuses_a_page_size_a_pool_cannot_map(capsys, budget_name):
    for page_size in ("3", "0", "1000", str(mmap.PAGESIZE + 1), "-4KiB"):
        one_line_error(capsys, ["budget", "create", budget_name, "--bytes", "4MiB", f"--page-size={page_size}"])
        assert not os.path.exists(segment_path(budget_name))
    page_size = random.randint(1, 16) * mmap.PAGESIZE  # any multiple of the OS page: what a host pool maps
    assert main(["budget", "create", budget_name, "--bytes", "4MiB", "--page-size", str(page_size)]) == 0
    budget = SharedBudget.open(budget_name)
    assert budget.page_size == page_size
    pool = PagePool("cpu", capacity_bytes=1 << 20, page_size=page_size, shared_budget=budget_name)
    assert pool.ensure_free(2)
    pool.leave_budget()
    budget.close()


def test_remove_of_a_budget_in_use_needs_force(capsys, budget_name):
    assert main(["budget", "create", budget_name, "--bytes", "4MiB"]) == 0
    pool = PagePool("cpu", capacity_bytes=4 << 20, shared_budget=budget_name, member_name="holder")
    assert pool.ensure_free(4)
    capsys.readouterr()
    assert "holder" in one_line_error(capsys, ["budget", "remove", budget_name])
    assert os.path.exists(segment_path(budget_name))  # refused: nothing changed
    assert [m.name for m in SharedBudget.open(budget_name).state().members] == ["holder"]
    assert main(["budget", "remove", budget_name, "--force"]) == 0
    assert not os.path.exists(segment_path(budget_name))
    pool.leave_budget()
    assert main(["budget", "create", budget_name, "--bytes", "4MiB"]) == 0
    assert main(["budget", "remove", budget_name]) == 0  # no member: removed without --force


def test_limit_selects_by_name_index_or_pid_never_ambiguously(capsys, budget_name):
    assert main(["budget", "create", budget_name, "--bytes", "4MiB"]) == 0
    one = PagePool("cpu", capacity_bytes=4 << 20, shared_budget=budget_name, member_name="1")  # index 0
    other = PagePool("cpu", capacity_bytes=4 << 20, shared_budget=budget_name, member_name="other")  # index 1
    budget = SharedBudget.open(budget_name)

    def ceilings():
        return {m.name: m.ceiling_bytes for m in budget.state().members}

    assert {m.name: m.index for m in budget.state().members} == {"1": 0, "other": 1}
    assert main(["budget", "limit", budget_name, "--member", "1", "--max", "1MiB"]) == 0
    assert ceilings() == {"1": 1 << 20, "other": 4 << 20}  # the name "1", not index 1
    assert main(["budget", "limit", budget_name, "--index", "1", "--max", "2MiB"]) == 0
    assert ceilings() == {"1": 1 << 20, "other": 2 << 20}
    assert main(["budget", "limit", budget_name, "--pid", str(os.getpid()), "--max", "3MiB"]) == 0
    assert ceilings() == {"1": 3 << 20, "other": 3 << 20}
    capsys.readouterr()
    one_line_error(capsys, ["budget", "limit", budget_name, "--member", "0", "--max", "1MiB"])  # index 0's name is "1"
    one_line_error(capsys, ["budget", "limit", budget_name, "--index", "7", "--max", "1MiB"])
    one_line_error(capsys, ["budget", "limit", budget_name, "--member", "1", "--max", "1e400"])
    assert ceilings() == {"1": 3 << 20, "other": 3 << 20}
    one.leave_budget()
    other.leave_budget()
    budget.close()


def test_a_damaged_segment_is_one_line_at_exit(budget_name):
    SharedBudget.create(budget_name, 4 << 20).close()
    with open(segment_path(budget_name), "r+b") as f:
        f.seek(random.randint(200, 1000))
        f.write(os.urandom(64))  # the member table, written outside vpaged
        f.seek(0)
        f.write(b"garbage!")  # and the magic
    for argv in (["show", budget_name], ["limit", budget_name, "--member", "x", "--max", "1MiB"]):
        r = cli(*argv)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert budget_name in r.stderr
    r = cli("remove", budget_name)  # a damaged budget is removed without asking: that is its fix
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(segment_path(budget_name))


def imports_as_other_user() -> bool:
    """Whether `python -m vpaged.cli` can run as another uid: not where the checkout or its Python lies under a
    directory that uid cannot enter (a clone under a 0700 mktemp directory)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    probe = ["setpriv", "--reuid=64012", "--regid=64012", "--clear-groups", sys.executable, "-c", "import vpaged.cli"]
    env = {**os.environ, "PYTHONPATH": ROOT, "HOME": "/tmp"}
    return subprocess.run(probe, capture_output=True, timeout=120, env=env, cwd="/tmp").returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to act as two users")
@pytest.mark.skipif(
    os.geteuid() == 0 and shutil.which("setpriv") is not None and not imports_as_other_user(),
    reason="another uid cannot import this checkout's vpaged (it lies under a directory only its owner enters)",
)
def test_another_users_remove_is_one_line(budget_name):
    owner, stranger = 64011, 64012
    r = cli("create", budget_name, "--bytes", "4MiB", user=owner)
    assert r.returncode == 0, r.stderr
    r = cli("remove", budget_name, user=stranger)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert os.path.exists(segment_path(budget_name)) and os.stat(segment_path(budget_name)).st_uid == owner
    assert cli("remove", budget_name, user=owner).returncode == 0
