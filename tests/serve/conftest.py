"""Tests of the engine, its stores and scheduler, sampling and the OpenAI-compatible server (vpaged/serve/)."""

import pytest
import torch
from serve_helpers import save_model_with_tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread_per_module(one_torch_thread):
    """Every module here runs torch on one intra-op thread (tests/conftest.py: one_torch_thread)."""
    yield


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory):
    """A random-weight llama-tiny with a word tokenizer (serve_helpers.save_model_with_tokenizer), loaded once
    per module: (model, tokenizer)."""
    from vpaged.serve import load_model

    path = tmp_path_factory.mktemp("tiny-llama")
    save_model_with_tokenizer(path)
    return load_model(str(path), dtype=torch.float32)


@pytest.fixture(scope="module")
def model():
    """random:llama-tiny as the engine loads it (vpaged.serve.load_model; seeded, so every load has the same
    weights)."""
    from vpaged.serve import load_model

    return load_model("random:llama-tiny")[0]


@pytest.fixture(scope="module")
def reference():
    """The same weights on transformers' own path (a second load: the engine may prepack or fuse its model),
    for model.generate references."""
    from vpaged.serve import load_model

    return load_model("random:llama-tiny")[0]
