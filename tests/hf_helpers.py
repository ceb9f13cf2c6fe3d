"""Shared by the transformers tests: left-padded random prompts and generate() through a given cache."""

import warnings

import torch

from vpaged.hf import cache_kwargs

VOCAB = 128
PAD = 0


def prompts(batch, length, gen, pads=()):
    ids = torch.randint(1, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row, p in enumerate(pads):  # left padding
        ids[row, :p] = PAD
        mask[row, :p] = 0
    return ids, mask


def generate(model, cache, ids, mask, seed=None, max_new_tokens=16, **kw):
    if seed is not None:
        torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generation-config chatter of random models
        return model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=max_new_tokens, **kw)
