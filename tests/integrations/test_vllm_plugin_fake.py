"""The vLLM plugin's KV backing on the CUDA backend without a GPU: the same per-block map and release that
the plugin's hooks drive (vpaged/integrations/vllm/backing.py), on a CUDA pool, through the fake driver
(tests/fake_cuda). The tensor vLLM would get needs a CUDA build of torch, so these checks read and write
the pages through their (host) addresses; test_cuda_cache.py's GPU-marked test of the backing covers the tensor.

The checks run as test_cuda_backend_fake.py runs its own (one child under the fake driver, a fresh fork
per check, no driver object left behind); this module only adds its checks to that runner's table."""

import gc
import random
import sys
from pathlib import Path

import pytest
import test_cuda_backend_fake as fake
import torch
from test_cuda_backend_fake import fake_driver_dir  # noqa: F401 - the fixture, compiled once per session

from vpaged.errors import InvalidArgumentError, OutOfPagesError
from vpaged.integrations.vllm.backing import BlockGeometry, KVBacking, make_pool
from vpaged.memory import PagePool

THIS_FILE = Path(__file__).resolve()
CHECKS: dict = {}


check = fake.check_registrar(CHECKS, "vllm_fake_results")  # @check(**env): a check run under the fake driver


@pytest.fixture(scope="module")
def vllm_fake_results(request, fake_driver_dir) -> dict:  # noqa: F811 - the imported fixture
    return fake.run_checks(request, fake_driver_dir, THIS_FILE, CHECKS, (str(THIS_FILE.parent),))


class CurrentStream:
    """Stands in for torch's current CUDA stream (a CPU build of torch has none): the legacy stream, 0."""

    cuda_stream = 0


def cuda_backing(nbytes, geom, pool=None) -> KVBacking:
    torch.cuda.current_stream = lambda device=None: CurrentStream()  # this child process only
    return KVBacking(nbytes, [geom], pool or make_pool(nbytes, "cuda:0"), "cuda:0")


def reference_pages(geom: BlockGeometry, blocks, page: int) -> set[int]:
    """Pages the blocks touch, from the KVCacheTensor formula span by span."""
    out = set()
    for b in blocks:
        for layer in range(geom.num_layers):
            start = geom.offset + layer * geom.layer_stride + b * geom.block_stride
            out.update(range(start // page, (start + geom.block_bytes - 1) // page + 1))
    return out


@check()
def test_fake_blocks_map_and_unmap_device_pages(drv, rng):
    """Random map / release of vLLM-shaped blocks on a CUDA pool: exactly the pages of held blocks are
    mapped (read-write), the others reserved only; a held block's bytes survive; releasing everything
    unmaps every page; a bad block id changes nothing."""
    page = drv.granularity
    r = random.Random(int(rng.integers(2**32)))
    layers, blocks = r.randint(1, 3), r.randint(12, 40)
    block_bytes = r.choice([page // 4, page // 2, page, page + page // 2])  # shared, whole and straddling
    geom = BlockGeometry(0, block_bytes * blocks, block_bytes, block_bytes, layers, blocks)
    nbytes = layers * blocks * block_bytes
    backing = cuda_backing(nbytes, geom)
    assert backing.page_size == page
    held: dict[int, int] = {}
    for _ in range(40):
        if r.random() < 0.6 or not held:
            new = r.sample(range(blocks), r.randint(1, 4))
            backing.map_blocks(new)
            for b in new:
                if b not in held:
                    held[b] = r.randint(1, 255)
                    for start, end in geom.spans(b):
                        fake.host_bytes(backing.address + start, end - start)[:] = held[b]
        else:
            gone = r.sample(sorted(held), r.randint(1, len(held)))
            unmaps = drv.calls("cuMemUnmap")
            backing.release_blocks(gone)
            for b in gone:
                del held[b]
            still = reference_pages(geom, held, page)
            if reference_pages(geom, gone, page) - still:
                assert drv.calls("cuMemUnmap") > unmaps
        want = reference_pages(geom, held, page)
        assert backing.stats().mapped_bytes == len(want) * page
        for p in range(backing.num_pages):
            assert fake.protection(backing.address + p * page) == ("rw-s" if p in want else "---p"), p
        for b, value in held.items():
            for start, end in geom.spans(b):
                assert (fake.host_bytes(backing.address + start, end - start) == value).all(), b
    before = backing.stats()
    with pytest.raises(InvalidArgumentError):
        backing.map_blocks([0, blocks])
    assert backing.stats() == before
    backing.release_blocks(range(blocks))
    assert backing.stats().mapped_bytes == 0
    del backing
    gc.collect()


@check()
def test_fake_step_short_of_pages_changes_nothing(drv, rng):
    """A step whose blocks need more device pages than the pool has fails with OutOfPagesError and maps
    nothing; the blocks mapped before stay mapped with their bytes."""
    page = drv.granularity
    geom = BlockGeometry(0, page, page, page, 1, 8)  # a block per page
    pool = PagePool("cuda:0", capacity_pages=3)
    backing = cuda_backing(8 * page, geom, pool)
    backing.map_blocks([1])
    fake.host_bytes(backing.address + page, page)[:] = 7
    before, maps = backing.stats(), drv.calls("cuMemMap")
    with pytest.raises(OutOfPagesError):
        backing.map_blocks([2, 3, 4])
    assert backing.stats() == before and not backing.is_mapped(2)
    assert (fake.host_bytes(backing.address + page, page) == 7).all()
    assert drv.calls("cuMemMap") - maps <= 3  # pages the pool may have created, never mapped into the range
    assert fake.protection(backing.address + 2 * page) == "---p"
    backing.release_blocks([1])
    del backing, pool
    gc.collect()


@check(FAKE_CUDA_DEVICES=2)
def test_fake_backing_tensor_names_the_device_index(drv, rng):
    """The tensor over the range is made on an indexed device ("cuda" is cuda:0), so torch never asks the
    driver which device an address of a reserved, not yet mapped range is on; the stream the range waits
    for is that device's; a pool of another device is refused before anything is reserved."""
    page = drv.granularity
    geom = BlockGeometry(0, page, page, page, 1, 4)
    made, streams = [], []

    def as_tensor(data, device=None, **kwargs):  # a CPU build of torch cannot make the CUDA tensor itself
        made.append((data.__cuda_array_interface__["data"][0], device))
        return torch.empty(0, dtype=torch.int8)

    torch.as_tensor = as_tensor
    torch.cuda.current_stream = lambda device=None: streams.append(device) or CurrentStream()
    for asked, index in [("cuda", 0), ("cuda:1", 1), (torch.device("cuda", 1), 1)]:
        pool = make_pool(4 * page, asked)
        backing = KVBacking(4 * page, [geom], pool, asked)
        assert backing.device == torch.device("cuda", index)
        assert backing.tensor.numel() == 0  # made before any page is mapped, as vLLM makes its views
        assert made[-1] == (backing.address, torch.device("cuda", index)), made[-1]
        assert streams[-1] == torch.device("cuda", index)
        backing.map_blocks([0, 3])
        assert backing.stats().mapped_bytes == 2 * page
        backing.release_blocks([0, 3])
        del backing, pool
        gc.collect()
    pool = make_pool(4 * page, "cuda:1")
    reservations = drv.live("reservations")
    with pytest.raises(InvalidArgumentError, match="cuda:0"):
        KVBacking(4 * page, [geom], pool, "cuda")
    assert drv.live("reservations") == reservations
    del pool
    gc.collect()


if __name__ == "__main__":  # the runner in the child process: python this_file RESULT_JSON CHECK...
    fake.CHECKS.update(CHECKS)
    fake._serve(sys.argv[1], sys.argv[2:])
