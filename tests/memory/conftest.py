"""Tests of the page pool, devices and host limits, the torch allocator hook, the CUDA backend (the real and
the fake driver) and the shared budget (vpaged/memory/)."""
