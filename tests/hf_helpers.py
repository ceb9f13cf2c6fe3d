"""Shared by the transformers tests: a tiny random Llama, left-padded random prompts and generate() through a
given cache."""

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


def tiny_llama(seed: int = 0, **config):
    """A 2-layer Llama (hidden 64, 4 heads over 2 kv heads, VOCAB tokens) with random weights from `seed`; config
    keywords override or add to its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**fields, **config})).eval()
