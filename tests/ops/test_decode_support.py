"""One rule for what the decode kernels take (vpaged.ops.support), and the transformers attention function
following it: a layer the CUDA kernels are not built for falls back to SDPA instead of raising."""

import pytest
import torch

from vpaged.ops.support import CUDA_HEAD_DIMS, decode_supported, decode_unsupported


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 112, 128, 192, 256])
def test_cuda_rule_names_the_built_head_sizes(head_dim):
    v = 128 if head_dim == 192 else head_dim
    ok = (head_dim, v) in CUDA_HEAD_DIMS
    assert decode_supported("cuda", torch.bfloat16, head_dim, v) is ok
    assert decode_supported("cpu", torch.bfloat16, head_dim, v)  # the CPU kernel takes every size
    if not ok:
        assert "built for head sizes" in decode_unsupported("cuda:0", torch.bfloat16, head_dim, v)


def test_cuda_rule_needs_aligned_rows():
    # bf16: 8 elements are 16 bytes; a token stride of 68 elements (136 bytes) breaks the alignment.
    assert decode_supported("cuda", torch.bfloat16, 64, 64, strides=(64 * 8 * 1024, 64 * 8, 64))
    assert "16-byte" in decode_unsupported("cuda", torch.bfloat16, 64, 64, strides=(68,))
    assert decode_supported("cpu", torch.bfloat16, 64, 64, strides=(68,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8])
def test_dtypes_outside_the_kernels(dtype):
    assert "float32, float16 and bfloat16" in decode_unsupported("cpu", dtype, 64)


def test_head_sizes_past_the_kernels():
    assert decode_unsupported("cpu", torch.float32, 257) is not None
    assert decode_unsupported("cpu", torch.float32, 64, 0) is not None


def test_attention_function_falls_back_where_the_cuda_rule_says_no(monkeypatch):
    pytest.importorskip("transformers")
    from vpaged.hf import attention

    q = torch.randn(2, 4, 1, 96)
    k = torch.randn(2, 2, 9, 96)
    v = torch.randn(2, 2, 9, 96)
    assert attention._kernel_decodes(q, k, v, None, 0.0, {})  # the CPU kernel takes head size 96
    # The same tensors judged by the CUDA rule (what a CUDA tensor would get): SDPA, not a raising kernel.
    monkeypatch.setattr(attention, "decode_supported", lambda device, *a, **kw: decode_supported("cuda", *a, **kw))
    assert not attention._kernel_decodes(q, k, v, None, 0.0, {})
    k64, v64 = torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    assert attention._kernel_decodes(torch.randn(2, 4, 1, 64), k64, v64, None, 0.0, {})


@pytest.mark.parametrize("kv", ["vpaged", "paged"])
def test_engine_sends_decode_rows_to_sdpa_where_the_kernel_says_no(kv, monkeypatch):
    """A store whose geometry the kernel does not take (the CUDA rule for head size 16, applied on the CPU)
    never calls the decode kernel: its decode rows attend through SDPA, with the tokens the kernel gives."""
    pytest.importorskip("transformers")
    from vpaged.serve import LLM, SamplingParams
    from vpaged.serve.stores import paged as paged_store
    from vpaged.serve.stores import virtual as virtual_store

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    options = dict(kv_budget_bytes=16 << 20, kv=kv, max_num_seqs=4)
    with_kernel = [o.outputs[0].token_ids for o in LLM("random:llama-tiny", **options).generate(prompts, params)]

    cuda_rule = lambda device, *a, **kw: decode_unsupported("cuda", *a, **kw)  # noqa: E731
    for module in (virtual_store, paged_store):
        monkeypatch.setattr(module, "decode_unsupported", cuda_rule)

    class NoKernel:  # the stores' decode rows reach the kernel through a DecodePlan only
        @staticmethod
        def build(*a, **kw):
            raise AssertionError("the decode kernel was called for a geometry it does not take")

    for module in (virtual_store, paged_store):
        monkeypatch.setattr(module, "DecodePlan", NoKernel)
    llm = LLM("random:llama-tiny", **options)
    assert "built for head sizes" in llm.engine.store.decode_unsupported
    by_sdpa = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert by_sdpa == with_kernel
