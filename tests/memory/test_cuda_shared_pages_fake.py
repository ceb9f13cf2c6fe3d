"""Device pages shared between processes on the CUDA backend, without a GPU: a page exported as a POSIX file
descriptor (PagePool.export_pages, cuMemExportToShareableHandle) and sent over a Unix socket is imported by another
process (PagePool.import_pages, cuMemImportFromShareableHandle) and mapped into its ranges read-only: the same memory,
no copy; a writer gets its own copy; the exporter's death does not end the importer's pages; bad descriptors, pages of
another size or device, and devices without POSIX handles are refused with typed errors that change nothing.

The checks run as test_cuda_backend_fake.py runs its own (one child process whose LD_LIBRARY_PATH finds the fake
driver, a fresh fork per check, no API violation and no driver object left behind afterwards). A check that needs a
second process starts this file again as a peer (`python this_file --peer ROLE SOCKET_FD SEED`), under the same fake
driver: the peer makes its own pool, writes pages, sends their descriptors and checksums over the socket, and checks
its own side (its pages unchanged, no driver object left) before it answers. Device pointers under the fake are host
addresses: pages are read and written with numpy through the ranges' mappings."""

import gc
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import test_cuda_backend_fake as fake
from test_cuda_backend_fake import fake_driver_dir  # noqa: F401 - the fixture, compiled once per session

import vpaged._C as C
from vpaged.errors import InvalidArgumentError

THIS_FILE = Path(__file__).resolve()
CHECKS: dict = {}
PEER_TIMEOUT_S = 20

check = fake.check_registrar(CHECKS, "shared_pages_fake_results")  # @check(**env): a check under the fake driver


@pytest.fixture(scope="module")
def shared_pages_fake_results(request, fake_driver_dir) -> dict:  # noqa: F811 - the imported fixture
    return fake.run_checks(request, fake_driver_dir, THIS_FILE, CHECKS, (str(THIS_FILE.parent),))


# ---------------------------------------------------------------------------------------------------
# Helpers inside a check's process (and the peer's).


def digest(address: int, nbytes: int) -> str:
    return hashlib.sha256(fake.host_bytes(address, nbytes).tobytes()).hexdigest()


def written_range(drv, rng, pool, n: int):
    """A range of n new pages of `pool`, each filled with random bytes; returns it with each page's checksum."""
    g = pool.page_size
    r = C.VirtualRange(pool, n * g)
    r.map_new(list(range(n)))
    for i in range(n):
        fake.host_bytes(r.address + i * g, g)[:] = fake.random_bytes(rng, g)
    return r, [digest(r.address + i * g, g) for i in range(n)]


def start_peer(role: str, sock: socket.socket, seed: int) -> subprocess.Popen:
    """This file as a peer process (same environment: the fake driver, vpaged, these helpers)."""
    return subprocess.Popen(
        [sys.executable, str(THIS_FILE), "--peer", role, str(sock.fileno()), str(seed)],
        pass_fds=(sock.fileno(),),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish_peer(proc: subprocess.Popen, expect_rc: int = 0) -> None:
    out, _ = proc.communicate(timeout=PEER_TIMEOUT_S)
    assert proc.returncode == expect_rc, f"the peer exited with {proc.returncode}:\n{out}"


def receive(sock: socket.socket, max_fds: int = 64) -> tuple[dict, list[int]]:
    sock.settimeout(PEER_TIMEOUT_S)
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, max_fds)
    assert msg, "the peer closed the socket without sending"
    return json.loads(msg), fds


def close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------
# The peer (another process under the fake driver).

PEER_PAGES = 4


def peer(role: str, sock_fd: int, seed: int) -> int:
    """export: write PEER_PAGES pages, send their descriptors and checksums, wait for "check", answer whether its
    pages are unchanged, tear down and check that nothing is left; export-and-die: the same send, then SIGKILL."""
    drv = fake.FakeDriver()
    rng = np.random.default_rng(seed)
    sock = socket.socket(fileno=sock_fd)
    backend, pool = fake.make_pool(drv, PEER_PAGES)
    r, hashes = written_range(drv, rng, pool, PEER_PAGES)
    ids = r.pages_at(list(range(PEER_PAGES)))
    fds = pool.export_pages(ids)
    socket.send_fds(sock, [json.dumps({"hashes": hashes, "page_size": pool.page_size}).encode()], fds)
    close_all(fds)
    if role == "export-and-die":
        os.kill(os.getpid(), signal.SIGKILL)
    sock.settimeout(PEER_TIMEOUT_S)
    assert sock.recv(16) == b"check"
    g = pool.page_size
    unchanged = [digest(r.address + i * g, g) for i in range(PEER_PAGES)] == hashes
    del r, ids
    gc.collect()
    del pool, backend
    gc.collect()
    drv.assert_clean()
    sock.sendall(json.dumps({"unchanged": unchanged}).encode())
    return 0


# ---------------------------------------------------------------------------------------------------
# Checks


@check()
def test_pages_another_process_exported_map_here_read_only_with_no_copy(drv, rng):
    mine, theirs = socket.socketpair()
    proc = start_peer("export", theirs, int(rng.integers(1 << 31)))
    theirs.close()
    try:
        sent, fds = receive(mine)
        g = drv.granularity
        assert sent["page_size"] == g and len(fds) == PEER_PAGES
        backend, pool = fake.make_pool(drv, PEER_PAGES)
        assert backend.can_share_pages
        bytes_before = drv.live("allocated_bytes")
        copies = drv.snapshot()
        ids = pool.import_pages(fds)
        close_all(fds)  # the ids hold the memory now, not the descriptors
        stats = pool.stats()
        # Imported pages are not the pool's memory: they take none of its capacity.
        assert stats.imported_pages == PEER_PAGES and stats.used_pages == 0 and pool.free_pages() == PEER_PAGES
        assert all(pool.is_imported_page(i) and not pool.is_file_page(i) for i in ids)
        assert [pool.refcount(i) for i in ids] == [1] * PEER_PAGES
        assert drv.live("allocated_bytes") == bytes_before, "an import holds the exporter's memory, not new memory"

        r = C.VirtualRange(pool, PEER_PAGES * g)
        order = [int(i) for i in rng.permutation(PEER_PAGES)]  # index k shows the peer's page order[k]
        r.map_shared(list(range(PEER_PAGES)), [ids[j] for j in order])
        for k, j in enumerate(order):
            assert digest(r.address + k * g, g) == sent["hashes"][j], f"index {k} does not show the peer's page {j}"
            assert fake.protection(r.address + k * g).startswith("r--"), "an imported page must map read-only"
        assert drv.calls_since(copies, *fake.COPY_CALLS) == {}, "a shared page is mapped, never copied"

        host = fake.random_bytes(rng, g)
        with pytest.raises(InvalidArgumentError, match="imported"):
            pool.copy_from_host(ids[0], host.ctypes.data)

        # A writer gets its own page: copy-on-write copies the shared one, which stays as it was.
        k = int(rng.integers(PEER_PAGES))
        fresh = r.copy_on_write(k)
        assert not pool.is_imported_page(fresh) and pool.stats().used_pages == 1
        assert digest(r.address + k * g, g) == sent["hashes"][order[k]]
        assert fake.protection(r.address + k * g).startswith("rw")
        fake.host_bytes(r.address + k * g, g)[:] = host
        # make_private copies an imported page even when the range holds its only reference.
        pool.decref_all(ids)
        others = [i for i in range(PEER_PAGES) if i != k]
        assert r.copies_needed(others) == len(others)
        assert r.make_private(others) == len(others)
        assert pool.stats().imported_pages == 0, "the last reference of an imported page releases it"
        for i in others:
            assert digest(r.address + i * g, g) == sent["hashes"][order[i]]

        mine.sendall(b"check")
        mine.settimeout(PEER_TIMEOUT_S)
        assert json.loads(mine.recv(1 << 10)) == {"unchanged": True}, "a write here reached the exporter's page"
        finish_peer(proc)
        del r, pool, backend
    finally:
        mine.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@check()
def test_imported_pages_outlive_the_process_that_exported_them(drv, rng):
    mine, theirs = socket.socketpair()
    proc = start_peer("export-and-die", theirs, int(rng.integers(1 << 31)))
    theirs.close()
    try:
        sent, fds = receive(mine)
        finish_peer(proc, -signal.SIGKILL)  # dead before anything is imported
        g = drv.granularity
        backend, pool = fake.make_pool(drv, 1)
        ids = pool.import_pages(fds)
        close_all(fds)
        r = C.VirtualRange(pool, PEER_PAGES * g)
        r.map_shared(list(range(PEER_PAGES)), ids)
        pool.decref_all(ids)
        assert [digest(r.address + i * g, g) for i in range(PEER_PAGES)] == sent["hashes"]
        del r
        gc.collect()
        assert pool.stats().imported_pages == 0
        del pool, backend
    finally:
        mine.close()


@check()
def test_bad_descriptors_and_misuse_are_refused_and_change_nothing(drv, rng):
    g = drv.granularity
    backend_a, a = fake.make_pool(drv, 4)
    r, hashes = written_range(drv, rng, a, 2)
    good = a.export_pages(r.pages_at([0, 1]))
    backend_b, b = fake.make_pool(drv, 4)
    with tempfile.TemporaryFile() as plain:
        plain.truncate(g)
        read_end, write_end = os.pipe()
        try:
            for bad in (plain.fileno(), read_end):
                live = drv.live_objects()
                with pytest.raises(InvalidArgumentError, match="not a shareable CUDA allocation"):
                    b.import_pages([good[0], bad])  # the good one is undone: all or nothing
                assert drv.live_objects() == live and b.stats().imported_pages == 0
        finally:
            os.close(read_end)
            os.close(write_end)

    # A free page has nothing to export.
    free = a.acquire(1)
    a.decref_all(free)
    with pytest.raises(InvalidArgumentError, match="free page"):
        a.export_pages(free)

    # A page smaller than the importer's is refused (the descriptor does not say its size: importer and exporter
    # agree on the page size beforehand, as a store's fingerprint does).
    backend_big = C.cuda_backend(0, 2 * g, 2, 0)
    big = C.PagePool(backend_big, 0, 2)
    live = drv.live_objects()
    with pytest.raises(InvalidArgumentError, match="does not map as one page"):
        big.import_pages(good[:1])
    assert drv.live_objects() == live and big.stats().imported_pages == 0

    # The good descriptors still import, and a pool torn down with imports referenced releases them.
    ids = b.import_pages(good)
    assert b.stats().imported_pages == 2
    close_all(good)
    out = np.empty(g, np.uint8)
    for i, page in enumerate(ids):
        b.copy_to_host(page, out.ctypes.data)
        backend_b.synchronize()
        assert hashlib.sha256(out.tobytes()).hexdigest() == hashes[i]
    with pytest.raises(InvalidArgumentError, match="imported"):
        b.export_pages(ids)  # only the pool's own pages are exported
    del r, a, b, big, backend_a, backend_b, backend_big, ids


@check(FAKE_CUDA_DEVICES=2)
def test_a_page_of_another_device_is_refused(drv, rng):
    _, on_1 = fake.make_pool(drv, 2, device=1)
    r = C.VirtualRange(on_1, drv.granularity)
    r.map_new([0])
    fds = on_1.export_pages(r.pages_at([0]))
    _, on_0 = fake.make_pool(drv, 2, device=0)
    with pytest.raises(InvalidArgumentError, match="not on cuda:0"):
        on_0.import_pages(fds)
    assert on_0.stats().imported_pages == 0
    _, also_on_1 = fake.make_pool(drv, 2, device=1)
    assert len(also_on_1.import_pages(fds)) == 1
    close_all(fds)
    del r, on_1, on_0, also_on_1


def refuses_sharing(drv, reason: str) -> None:
    backend, pool = fake.make_pool(drv, 2)
    assert not backend.can_share_pages
    r = C.VirtualRange(pool, drv.granularity)
    r.map_new([0])  # the pages themselves work as ever
    refusal = f"cannot share pages with other processes: {reason}"
    with pytest.raises(InvalidArgumentError, match=refusal):
        pool.export_pages(r.pages_at([0]))
    with pytest.raises(InvalidArgumentError, match=refusal):
        pool.import_pages([0])
    del r, pool, backend


@check(FAKE_CUDA_POSIX_FD=0)
def test_a_device_without_posix_handles_makes_pages_that_are_not_shared(drv, rng):
    refuses_sharing(drv, "the device does not support POSIX file-descriptor handles")


@check(VPAGED_CUDA_SHAREABLE_PAGES=0)
def test_shareable_pages_can_be_turned_off(drv, rng):
    refuses_sharing(drv, "VPAGED_CUDA_SHAREABLE_PAGES=0")


def test_host_pools_do_not_share_device_pages():
    import vpaged

    pool = vpaged.PagePool(page_size=4096, capacity_pages=2)
    assert not pool.can_share_pages
    with pytest.raises(InvalidArgumentError, match="cannot share pages"):
        pool.import_pages([0])


if __name__ == "__main__":
    if sys.argv[1] == "--peer":  # python this_file --peer ROLE SOCKET_FD SEED
        sys.exit(peer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    fake.CHECKS.update(CHECKS)  # the runner in the child process: python this_file RESULT_JSON CHECK...
    fake._serve(sys.argv[1], sys.argv[2:])
