"""Tests of the decode kernels, their plans, write_kv and the fused CPU ops (vpaged/ops/)."""
