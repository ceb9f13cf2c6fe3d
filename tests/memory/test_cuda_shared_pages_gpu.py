"""Device pages shared between two processes on one real GPU (marked gpu; scripts/gpu_check.sh's
test:shared_pages stage): a peer process writes pages, exports them as POSIX file descriptors and sends them over a
Unix socket; this process imports them, maps them into a range and reads them through a torch view (DLPack) and
through the pool's copies, bit for bit against the peer's checksums, with no copy made by the import; a
copy-on-write page is written here and the peer finds its own pages unchanged. The same protocol runs without a GPU
under the fake driver in test_cuda_shared_pages_fake.py."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import vpaged._C as C

THIS_FILE = Path(__file__).resolve()
PAGES = 3
TIMEOUT_S = 60
KDL_UINT = 1


def usable_reason():
    if not C.built_with_cuda():
        return "vpaged was built without CUDA"
    return C.cuda_unavailable_reason(0) or None


def page_digest(pool, page) -> str:
    out = np.empty(pool.page_size, np.uint8)
    pool.copy_to_host(page, out.ctypes.data)
    pool.backend.synchronize()
    return hashlib.sha256(out.tobytes()).hexdigest()


def peer(sock_fd: int, seed: int) -> int:
    """Write PAGES pages, send their descriptors and checksums, wait for "check", answer whether they are unchanged."""
    sock = socket.socket(fileno=sock_fd)
    g = C.cuda_granularity(0)
    pool = C.PagePool(C.cuda_backend(0, g, PAGES, 0), 0, PAGES)
    r = C.VirtualRange(pool, PAGES * g)
    pages = r.map_new(list(range(PAGES)))
    rng = np.random.default_rng(seed)
    for page in pages:
        data = rng.integers(0, 256, g, dtype=np.uint8)
        pool.copy_from_host(page, data.ctypes.data)
    pool.backend.synchronize()
    hashes = [page_digest(pool, p) for p in pages]
    fds = pool.export_pages(pages)
    socket.send_fds(sock, [json.dumps({"hashes": hashes}).encode()], fds)
    for fd in fds:
        os.close(fd)
    sock.settimeout(TIMEOUT_S)
    assert sock.recv(16) == b"check"
    sock.sendall(json.dumps({"unchanged": [page_digest(pool, p) for p in pages] == hashes}).encode())
    return 0


@pytest.mark.gpu
def test_pages_another_process_exported_read_the_same_here_through_torch():
    reason = usable_reason()
    if reason:
        pytest.skip(reason)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    g = C.cuda_granularity(0)
    backend = C.cuda_backend(0, g, PAGES, 0)
    if not backend.can_share_pages:
        pytest.skip("this device's pages cannot be shared (no POSIX file-descriptor handles)")
    mine, theirs = socket.socketpair()
    seed = int.from_bytes(os.urandom(4), "little")
    proc = subprocess.Popen(
        [sys.executable, str(THIS_FILE), "--peer", str(theirs.fileno()), str(seed)],
        pass_fds=(theirs.fileno(),),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    theirs.close()
    try:
        mine.settimeout(TIMEOUT_S)
        msg, fds, _, _ = socket.recv_fds(mine, 1 << 16, PAGES)
        assert msg, f"the peer sent nothing:\n{proc.communicate(timeout=TIMEOUT_S)[0]}"
        hashes = json.loads(msg)["hashes"]
        pool = C.PagePool(backend, 0, PAGES)
        ids = pool.import_pages(fds)
        for fd in fds:
            os.close(fd)
        assert pool.stats().imported_pages == PAGES and pool.stats().used_pages == 0
        assert [page_digest(pool, i) for i in ids] == hashes
        r = C.VirtualRange(pool, PAGES * g)
        r.map_shared(list(range(PAGES)), ids)
        pool.decref_all(ids)
        for k in range(PAGES):  # a kernel (torch's copy) reads the imported page through the range
            view = torch.from_dlpack(r.view(k * g, [g], [1], KDL_UINT, 8))
            got = view.cpu().numpy()
            assert hashlib.sha256(got.tobytes()).hexdigest() == hashes[k], f"index {k} reads other bytes"
            del view
        k = PAGES - 1
        r.copy_on_write(k)
        view = torch.from_dlpack(r.view(k * g, [g], [1], KDL_UINT, 8))
        view.fill_(7)
        torch.cuda.synchronize()
        del view
        mine.sendall(b"check")
        assert json.loads(mine.recv(1 << 10)) == {"unchanged": True}, "a write here reached the exporter's page"
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, out
        del r
        assert pool.stats().imported_pages == 0
    finally:
        mine.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":  # python this_file --peer SOCKET_FD SEED
    sys.exit(peer(int(sys.argv[2]), int(sys.argv[3])))
