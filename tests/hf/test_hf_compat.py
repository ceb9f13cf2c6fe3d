"""vpaged/hf/compat.py: the supported transformers range, the cache keyword, and attention registration,
on whichever transformers release is installed (scripts/test_transformers_versions.sh runs this file on the
oldest supported release and the newest)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from vpaged.errors import InvalidArgumentError
from vpaged.hf import compat as _hf_compat

transformers = pytest.importorskip("transformers")
from hf_helpers import VOCAB, tiny_llama  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from vpaged.hf import VPagedCache, cache_kwargs, register_attention  # noqa: E402


@pytest.mark.parametrize(
    "version, supported, words",
    [
        ("5.16.1", False, "too old"),
        ("5.17.0", True, "supported"),
        ("5.17.0.dev0", True, "supported"),
        ("5.24.0", True, "supported"),
        ("5.31.2", True, "newer than the newest tested"),
        ("6.0.0", False, "untested"),
        ("4.57.6", False, "too old"),
    ],
)
def test_support_status_of_versions(version, supported, words):
    got_version, got_supported, why = _hf_compat.support_status(version)
    assert (got_version, got_supported) == (version, supported)
    assert words in why


def test_installed_release_is_supported():
    version, supported, why = _hf_compat.support_status()
    assert version == transformers.__version__
    assert supported, why


def _model(seed=0, **kw):
    return tiny_llama(seed, **kw)


def _left_padded(rng, lengths):
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(1, VOCAB, (n,), generator=rng)
        mask[row, -n:] = 1
    return ids, mask


def _generate(model, ids, mask, cache, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generation-config chatter of a random model
        return model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=12, **kw)


def test_cache_keyword_is_the_one_this_release_takes(rng):
    model = _model()
    ids, mask = _left_padded(rng, [7, 4])
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), do_sample=False)
    cache = VPagedCache(model.config, max_cache_len=64, capacity_bytes=1 << 20, page_size=4096)
    out = _generate(model, ids, mask, cache, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == out.shape[1] - 1  # the cache was used, not a default one
    keyword = _hf_compat.cache_keyword()
    if keyword == "past_key_values":
        # The newer spelling is refused by this release: the keyword really depends on the release.
        with pytest.raises(ValueError, match="cache"):
            model.generate(
                ids, attention_mask=mask, cache=VPagedCache(model.config, max_cache_len=64), max_new_tokens=2
            )
    else:
        assert _hf_compat._parse(transformers.__version__) >= (5, 24)


def test_max_cache_len_and_batch_size_are_plain_attributes():
    # In 5.17 the base class has read-only properties of these names.
    cache = VPagedCache(_model().config, max_cache_len=40, max_batch_size=3)
    assert (cache.max_cache_len, cache.max_batch_size) == (40, 3)
    assert cache.get_max_length() == 40
    cache.max_cache_len = 50
    assert cache.get_max_length() == 50


# ------------------------------------------------------------------------------------------ attention functions
def _sdpa_equivalent(calls):
    """What transformers' SDPA attention does, written against the documented signature only."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        calls.append(sorted(kwargs))
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        is_causal = bool(is_causal and attention_mask is None and query.shape[2] > 1)
        if attention_mask is not None:
            attention_mask = attention_mask[:, :, :, : key.shape[-2]]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
        )
        return out.transpose(1, 2).contiguous(), None

    return attention


@pytest.fixture
def registered():
    names = []

    def register(name, fn, **kw):
        names.append(name)
        register_attention(name, fn, **kw)

    yield register
    for name in names:
        _hf_compat.unregister_attention(name)


@pytest.mark.parametrize("kind", ["greedy", "beams"])
def test_registered_attention_gives_the_default_tokens(registered, rng, kind):
    calls = []
    registered("vpaged_test_sdpa", _sdpa_equivalent(calls))
    reference = _model(seed=3)
    custom = _model(seed=3, attn_implementation="vpaged_test_sdpa")
    assert custom.config._attn_implementation == "vpaged_test_sdpa"
    ids, mask = _left_padded(rng, [11, 5, 8])
    kw = dict(do_sample=False) if kind == "greedy" else dict(do_sample=False, num_beams=3)
    ref = _generate(reference, ids, mask, DynamicCache(config=reference.config), **kw)
    for cache in (
        DynamicCache(config=custom.config),
        VPagedCache(custom.config, max_cache_len=64, capacity_bytes=4 << 20, page_size=4096),
    ):
        calls.clear()
        out = _generate(custom, ids, mask, cache, **kw)
        assert torch.equal(out, ref), type(cache).__name__
        # Every layer of every step went through the registered function: prefill + 11 decode steps.
        assert len(calls) == custom.config.num_hidden_layers * 12
        # What vpaged/hf/compat.py documents arrives in every call (more may: the function takes **kwargs).
        assert all("position_ids" in names for names in calls), calls[0]


def test_registered_attention_logits_match_sdpa(registered, rng):
    calls = []
    registered("vpaged_test_sdpa", _sdpa_equivalent(calls))
    reference = _model(seed=5)
    custom = _model(seed=5)
    custom.set_attn_implementation("vpaged_test_sdpa")
    ids, mask = _left_padded(rng, [9, 3])
    with torch.no_grad():
        a = reference(input_ids=ids, attention_mask=mask).logits
        b = custom(input_ids=ids, attention_mask=mask).logits
    assert calls, "the registered function was not called"
    torch.testing.assert_close(b[mask.bool()], a[mask.bool()], rtol=1e-5, atol=1e-5)


def test_registered_attention_without_mask_gets_none(registered, rng):
    masks = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        out = F.scaled_dot_product_attention(
            query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), is_causal=query.shape[2] > 1
        )
        return out.transpose(1, 2).contiguous(), None

    registered("vpaged_test_nomask", attention, mask=None)
    model = _model(attn_implementation="vpaged_test_nomask")
    ids, mask = _left_padded(rng, [6, 6])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert masks and all(m is None for m in masks)


@pytest.mark.parametrize("name", ["", "sdpa", "eager", "paged|sdpa", 3])
def test_register_attention_refuses_builtin_or_bad_names(name):
    with pytest.raises(InvalidArgumentError):
        register_attention(name, lambda *a, **k: None)
    with pytest.raises(InvalidArgumentError):
        register_attention("vpaged_test_x", "not callable")


def test_serving_needs_the_release_it_is_verified_on():
    from vpaged.hf.compat import MIN_VERSION, SERVE_MIN_VERSION, serving_support

    need = ".".join(map(str, SERVE_MIN_VERSION))
    assert SERVE_MIN_VERSION == MIN_VERSION == (5, 17)  # the engine serves every release VPagedCache supports
    for version in ("5.17.0", "5.20.2", "5.24.0"):
        assert serving_support(version) == (True, "")
    ok, why = serving_support("5.16.1")
    assert not ok and f">= {need}" in why and "5.16.1" in why
    if _hf_compat.support_status()[1]:  # the installed release: the engine takes it (and its tests run)
        assert serving_support() == (True, "")
