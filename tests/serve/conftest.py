"""Tests of the engine, its stores and scheduler, sampling and the OpenAI-compatible server (vpaged/serve/)."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread_per_module(one_torch_thread):
    """Every module here runs torch on one intra-op thread (tests/conftest.py: one_torch_thread)."""
    yield
