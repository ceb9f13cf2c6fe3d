"""`vpaged store create | show | verify | remove` against real stores, one used by another process."""

import json
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from vpaged.cli.main import main
from vpaged.memory.store import PageStore

PAGE = 4096


@pytest.fixture
def store_name():
    name = f"test-cli-{uuid.uuid4().hex[:12]}"
    yield name
    PageStore.remove(name)


def test_create_show_verify_remove(store_name, capsys, rng):
    assert main(["store", "create", store_name, "--pages", "16", "--page-size", "4KiB"]) == 0
    assert "16 pages of 4096 bytes" in capsys.readouterr().out
    assert main(["store", "create", store_name, "--pages", "16"]) == 1
    assert "exists already" in capsys.readouterr().err
    pages = [np.random.default_rng(int(rng.initial_seed()) + i).integers(0, 256, PAGE, np.uint8) for i in range(3)]
    with PageStore.open(store_name) as store:
        for i, data in enumerate(pages):
            assert store.publish(bytes([i]) * 32, data) == "published"
        assert main(["store", "show", store_name, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["capacity_pages"], shown["page_bytes"], shown["published_pages"]) == (16, PAGE, 3)
        assert shown["processes"] == [] or all(p["pid"] for p in shown["processes"])
        assert main(["store", "verify", store_name]) == 0
        assert "3 published page(s) checked" in capsys.readouterr().out
        data_path = store.data_path
    with open(data_path, "r+b") as f:  # page of slot 1 overwritten outside vpaged
        f.seek(PAGE + 7)
        f.write(b"\x00\xff" * 8)
    assert main(["store", "verify", store_name]) == 1
    assert "fails its checksum" in capsys.readouterr().err
    assert main(["store", "remove", store_name]) == 0
    assert not PageStore.exists(store_name)
    assert main(["store", "show", store_name]) == 1
    assert "no page store" in capsys.readouterr().err
    assert main(["store", "remove", store_name]) == 1


HOLDER = textwrap.dedent(
    """
    import sys, time
    from vpaged.memory.store import PageStore
    store = PageStore.open(sys.argv[1])
    pin = store.pin([b"k" * 32])
    print(len(pin), flush=True)
    time.sleep(600)
    """
)


def test_remove_is_refused_while_another_process_uses_the_store(store_name, capsys):
    assert main(["store", "create", store_name, "--pages", "8", "--page-size", "4KiB"]) == 0
    with PageStore.open(store_name) as store:
        store.publish(b"k" * 32, bytes(PAGE))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, store_name], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        capsys.readouterr()
        assert main(["store", "show", store_name]) == 0
        out = capsys.readouterr().out
        assert "1 process(es) using it" in out and f"pid {holder.pid}: 1 page(s) pinned" in out
        assert main(["store", "remove", store_name]) == 1
        assert str(holder.pid) in capsys.readouterr().err and PageStore.exists(store_name)
        assert main(["store", "remove", store_name, "--force"]) == 0
        assert not PageStore.exists(store_name)
    finally:
        holder.kill()
        holder.wait()


def test_bad_input_is_one_line_on_stderr(store_name, capsys):
    assert main(["store", "create", "no/slash", "--pages", "8"]) == 1
    assert main(["store", "create", store_name, "--pages", "0", "--page-size", "4KiB"]) == 1
    assert main(["store", "create", store_name, "--pages", "8", "--page-size", "1000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("vpaged store: ") for line in err)
    assert not PageStore.exists(store_name)
