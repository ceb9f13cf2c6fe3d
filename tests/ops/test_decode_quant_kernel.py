"""Decode kernels on quantized K/V (int8 with a float32 scale after each head's row, fp8 e4m3fn and e5m2 with
per-tensor scales), called through _C directly on storage built here by hand, against a float64 reference on
the dequantized values (so the expected error is fp32 rounding), on every CPU code path this machine has.

Storage bytes outside the sequences' tokens are random garbage (int8 scales among them may be NaN or inf), so
a kernel reading a token it should not shows up in the output. Outputs are poisoned with NaN before each call.
"""

import math
from functools import partial

import pytest
import torch
from int8_contract_helpers import assert_within_contract, int8_dot_bound

from vpaged import _C
from vpaged.errors import InvalidArgumentError

ISAS = _C.decode_cpu_isas()
HAS_CUDA = torch.cuda.is_available()
CODES = {"int8": 3, "e4m3": 4, "e5m2": 5}
FORMATS = list(CODES)
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
LENGTHS = [1, 37, 1300, 300, 17]  # > 256 tokens: split items on 2 threads; none a multiple of 32
TOL = dict(rtol=1e-5, atol=1e-5)


def quantize(x, fmt, scale=1.0):
    """x [..., dim] fp32 -> (stored rows [..., dim] uint8, int8: [..., dim + 4] with the row's float32 scale
    appended; the dequantized fp32 values the kernel must see)."""
    if fmt == "int8":
        s = x.abs().amax(-1, keepdim=True) / 127
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.where(s > 0, torch.round(x / safe), torch.zeros_like(x)).clamp(-127, 127).to(torch.int8)
        return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8)], -1), q.float() * s
    f = (x / scale).to(FP8[fmt])
    return f.view(torch.uint8), f.float() * scale


def tensor_scales(fmt, k, v):
    """Per-tensor fp8 scales, different from each other and from 1 (unused for int8)."""
    if fmt == "int8":
        return 1.0, 1.0
    top = 240.0 if fmt == "e4m3" else 20000.0
    return float(k.abs().max()) / top, float(v.abs().max()) / (0.6 * top)


def reference(q, ks, vs, scale):
    """Attention of q[i] over ks[i], vs[i] in float64. GQA by grouping the query heads of each kv head
    rather than by repeating K/V (measured 2-6x cheaper: the CUDA grid builds ~100 references)."""
    num_seqs, num_heads, head_dim = q.shape
    hkv = ks[0].shape[1]
    out = torch.empty(num_seqs, num_heads, vs[0].shape[-1], dtype=torch.float64)
    for i, (k, v) in enumerate(zip(ks, vs)):
        grouped = q[i].double().view(hkv, num_heads // hkv, head_dim)
        s = torch.einsum("kgd,tkd->kgt", grouped, k.double()) * scale
        out[i] = torch.einsum("kgt,tkd->kgd", s.softmax(-1), v.double()).reshape(num_heads, -1)
    return out


def quantize_each(xs, fmt, scale=1.0):
    """quantize() of every sequence's rows in one call (int8 scales are per row, fp8's per tensor: the
    same bytes as one call per sequence): [(stored, dequantized)] per sequence."""
    stored, values = quantize(torch.cat(xs), fmt, scale)
    sizes = [x.shape[0] for x in xs]
    return list(zip(stored.split(sizes), values.split(sizes)))


def garbage(n, rng):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng)


def strides_of(layout, hkv, width, max_len):
    """(slot, token, head) strides in bytes of a contiguous store of rows `width` bytes wide."""
    if layout == "dense":
        return max_len * hkv * width, hkv * width, width
    if layout == "padded":  # heads and tokens apart by odd amounts: int8 scales land on unaligned addresses
        head = width + 7
        token = hkv * head + 3
        return max_len * token + 11, token, head
    assert layout == "head_major"
    return hkv * max_len * width, width, max_len * width


class Store:
    """One of K or V: a flat uint8 buffer of garbage holding each sequence's rows at its slot (contiguous) or
    in its blocks (paged), and the strides the kernel needs."""

    def __init__(self, rows, layout, max_len, rng, slots=None, tables=None, block_size=0, num_blocks=0):
        hkv, width = rows[0].shape[1], rows[0].shape[2]
        self.slot_stride, self.token_stride, self.head_stride = strides_of(layout, hkv, width, max_len)
        if tables is None:
            count, tokens = max(slots) + 1, max_len
        else:  # paged: block b's tokens are rows b * block_size .. of a [num_blocks * block_size, ...] store
            count, tokens = 1, num_blocks * block_size
            self.slot_stride = 0
        extent = (count - 1) * self.slot_stride + (tokens - 1) * self.token_stride + (hkv - 1) * self.head_stride
        self.buf = garbage(extent + width, rng)
        view = self.buf.as_strided(
            (count, tokens, hkv, width), (self.slot_stride, self.token_stride, self.head_stride, 1)
        )
        for i, r in enumerate(rows):
            n = r.shape[0]
            if tables is None:
                view[slots[i], :n] = r
            else:
                t = torch.arange(n)
                view[0, torch.tensor(tables[i])[t // block_size] * block_size + t % block_size] = r


def make_params(fmt, q, out, kst, vst, lengths, max_len, v_head_dim, scale, k_scale, v_scale, paged=None):
    """DecodeParams over two Stores; keeps the index tensors it points at in p._keep."""
    p = _C.DecodeParams()
    p.dtype, p.kv_dtype = 0, CODES[fmt]
    p.num_seqs, p.num_heads, p.head_dim = q.shape
    p.num_kv_heads = 0  # set below
    p.v_head_dim = v_head_dim
    p.q, p.out, p.k, p.v = q.data_ptr(), out.data_ptr(), kst.buf.data_ptr(), vst.buf.data_ptr()
    p.token_stride, p.head_stride = kst.token_stride, kst.head_stride
    p.v_token_stride, p.v_head_stride = vst.token_stride, vst.head_stride
    p.slot_stride, p.v_slot_stride = kst.slot_stride, vst.slot_stride
    lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    p.lengths, p.max_tokens = lens.data_ptr(), max_len
    keep = [lens]
    if paged is None:
        slots = torch.tensor(lengths.slots, dtype=torch.int32, device=q.device)
        p.slots = slots.data_ptr()
        keep.append(slots)
    else:
        tables, block_size, num_blocks = paged
        bt = torch.tensor(tables, dtype=torch.int32, device=q.device)
        p.paged, p.block_tables, p.bt_stride = True, bt.data_ptr(), bt.shape[1]
        p.block_size, p.num_blocks = block_size, num_blocks
        keep.append(bt)
    p.scale, p.k_scale, p.v_scale = scale, k_scale, v_scale
    return p, keep


class Lengths(list):
    """Sequence lengths with the slot of each sequence (contiguous stores)."""

    def __init__(self, lengths, slots):
        super().__init__(lengths)
        self.slots = slots


def case(fmt, group, head_dim, v_head_dim, layout, rng, lengths=LENGTHS, hkv=2, paged_block=0, device="cpu"):
    """Random K/V of `lengths`, quantized into Stores; returns (params, keep, q, out, reference)."""
    max_len = max(lengths)
    ks = [torch.randn(n, hkv, head_dim, generator=rng) for n in lengths]
    vs = [torch.randn(n, hkv, v_head_dim, generator=rng) for n in lengths]
    k_scale, v_scale = tensor_scales(fmt, torch.cat(ks), torch.cat(vs))
    kq, vq = quantize_each(ks, fmt, k_scale), quantize_each(vs, fmt, v_scale)
    paged = None
    if paged_block:
        blocks_each = [-(-n // paged_block) for n in lengths]
        num_blocks = sum(blocks_each) + 3
        perm = torch.randperm(num_blocks, generator=rng).tolist()
        tables, at = [], 0
        width = max(blocks_each)
        for nb in blocks_each:
            tables.append(perm[at : at + nb] + [0] * (width - nb))
            at += nb
        paged = (tables, paged_block, num_blocks)
        kst = Store(
            [r for r, _ in kq], layout, max_len, rng, tables=tables, block_size=paged_block, num_blocks=num_blocks
        )
        vst = Store(
            [r for r, _ in vq], layout, max_len, rng, tables=tables, block_size=paged_block, num_blocks=num_blocks
        )
        lens = list(lengths)
    else:
        slots = torch.randperm(len(lengths) + 2, generator=rng)[: len(lengths)].tolist()  # unused slots: garbage
        kst = Store([r for r, _ in kq], layout, max_len, rng, slots=slots)
        vst = Store([r for r, _ in vq], layout, max_len, rng, slots=slots)
        lens = Lengths(lengths, slots)
    q = torch.randn(len(lengths), hkv * group, head_dim, generator=rng)
    out = torch.full((len(lengths), hkv * group, v_head_dim), float("nan"))
    if device != "cpu":
        kst.buf, vst.buf, q, out = kst.buf.to(device), vst.buf.to(device), q.to(device), out.to(device)
    scale = 1.0 / math.sqrt(head_dim)
    p, keep = make_params(fmt, q, out, kst, vst, lens, max_len, v_head_dim, scale, k_scale, v_scale, paged)
    p.num_kv_heads = hkv
    ref = reference(q.cpu(), [d for _, d in kq], [d for _, d in vq], scale)
    if fmt == "int8":
        ref.int8_dot_bound = partial(int8_dot_bound, q.cpu(), [d for _, d in kq], [d for _, d in vq], scale)
    return p, (keep, kst, vst), q, out, ref


def run_cpu_all_isas(p, out, ref, threads=2):
    """Every CPU path against the float64 reference: within fp32 rounding (TOL), or for int8 on a path with integer
    products (_C.decode_cpu_int8_dot) within the contract's bound for the path's probability steps, which the
    reference carries (int8_dot_bound, given the steps)."""
    for isa in ISAS:
        out.fill_(float("nan"))
        _C.decode_cpu(p, threads, isa)
        assert torch.isfinite(out).all(), f"{isa}: output not fully written or not finite"
        if p.kv_dtype == CODES["int8"] and _C.decode_cpu_int8_dot(isa):
            bound = ref.int8_dot_bound(_C.decode_cpu_int8_dot_prob_steps(isa))
            assert_within_contract(out, ref, bound, TOL["atol"], TOL["rtol"], isa)
        else:
            torch.testing.assert_close(out.double(), ref, **TOL, msg=lambda m, isa=isa: f"{isa}: {m}")


@pytest.mark.parametrize("layout", ["dense", "padded", "head_major"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (96, 96), (192, 128)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_contiguous(fmt, group, dims, layout, rng):
    p, keep, q, out, ref = case(fmt, group, *dims, layout, rng)
    run_cpu_all_isas(p, out, ref)


@pytest.mark.parametrize("dims", [(128, 128), (80, 80), (192, 128)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_paged(fmt, group, block_size, dims, rng):
    p, keep, q, out, ref = case(fmt, group, *dims, "dense", rng, paged_block=block_size)
    run_cpu_all_isas(p, out, ref)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_thread_counts(fmt, threads, rng):
    p, keep, q, out, ref = case(fmt, 4, 128, 128, "dense", rng, lengths=[2100, 1, 700, 33], hkv=4)
    run_cpu_all_isas(p, out, ref, threads)


def test_int8_zero_rows(rng):
    """All-zero rows quantize to scale 0: zeros, not NaN (a sequence entirely of them, and some tokens of
    another)."""
    lengths = [40, 300]
    hkv, d = 2, 128
    ks = [torch.randn(n, hkv, d, generator=rng) for n in lengths]
    vs = [torch.randn(n, hkv, d, generator=rng) for n in lengths]
    ks[0].zero_()
    vs[0].zero_()
    ks[1][5:70].zero_()
    vs[1][100:133, 1].zero_()
    kq, vq = [quantize(k, "int8") for k in ks], [quantize(v, "int8") for v in vs]
    assert (kq[0][0][..., d:] == 0).all()  # the scale bytes of a zero row are those of 0.0
    slots = [1, 0]
    kst = Store([r for r, _ in kq], "dense", max(lengths), rng, slots=slots)
    vst = Store([r for r, _ in vq], "dense", max(lengths), rng, slots=slots)
    q = torch.randn(2, hkv * 4, d, generator=rng)
    out = torch.full((2, hkv * 4, d), float("nan"))
    scale = 1 / math.sqrt(d)
    p, keep = make_params("int8", q, out, kst, vst, Lengths(lengths, slots), max(lengths), d, scale, 1.0, 1.0)
    p.num_kv_heads = hkv
    ref = reference(q, [x for _, x in kq], [x for _, x in vq], scale)
    ref.int8_dot_bound = partial(int8_dot_bound, q, [x for _, x in kq], [x for _, x in vq], scale)
    assert (ref[0] == 0).all()
    run_cpu_all_isas(p, out, ref)
    assert (out[0] == 0).all()


def finite_bytes(fmt, pad_to=0):
    """Every byte value that decodes to a finite number, as uint8 (then zeros up to pad_to values)."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if fmt != "int8":
        b = b[torch.isfinite(b.view(FP8[fmt]).float())]
    return torch.cat([b, torch.zeros(max(0, pad_to - b.numel()), dtype=torch.uint8)])


def decoded(fmt, b):
    return b.view(torch.int8).float() if fmt == "int8" else b.view(FP8[fmt]).float()


def one_store(rows, device):
    """A dense store of one sequence's rows [n, 1, width] in slot 0."""
    st = Store.__new__(Store)
    st.buf = rows.reshape(-1).clone().to(device)
    st.slot_stride, st.token_stride, st.head_stride = rows.numel(), rows.shape[-1], rows.shape[-1]
    return st


def with_row_scale(fmt, vals):
    """Rows [n, 1, dim] of stored bytes; int8 with a float32 scale of 1 appended."""
    if fmt != "int8":
        return vals
    one = torch.ones(vals.shape[0], 1, 1).view(torch.uint8)
    return torch.cat([vals, one], -1)


def exhaustive_v(fmt, v_scale, device, run, pad_to=0):
    """One token whose V row holds every finite byte value: the output (probability exactly 1) is each value
    decoded times v_scale, bit for bit."""
    vals = finite_bytes(fmt, pad_to)
    dv = vals.numel()
    k_rows = with_row_scale(fmt, torch.zeros(1, 1, dv, dtype=torch.uint8))
    v_rows = with_row_scale(fmt, vals.view(1, 1, dv))
    kst, vst = one_store(k_rows, device), one_store(v_rows, device)
    q = torch.randn(1, 1, dv, device=device)
    out = torch.full((1, 1, dv), float("nan"), device=device)
    p, keep = make_params(fmt, q, out, kst, vst, Lengths([1], [0]), 1, dv, 0.25, 1.0, v_scale)
    p.num_kv_heads = 1
    expected = decoded(fmt, vals) * (v_scale if fmt != "int8" else 1.0)
    for label in run(p, out):
        assert torch.equal(out.view(-1).cpu(), expected), f"{label}: V bytes decoded wrongly"


def exhaustive_k(fmt, k_scale, device, run, pad_to=0, dv=2):
    """Two tokens: K row 0 holds every finite byte value, K row 1 zeros; V rows (1, 0, ...) and (0, 1, ...).
    Query head h is c_h times the one-hot of dim h (c_h a power of two bringing the score near 32), so out[h]
    is the softmax of (score_h, 0) and score_h = log(out0 / out1) = c_h * value_h * k_scale, recovered to
    ~1e-7 relative: far closer than the next representable value of any format (>= 1/8 relative)."""
    vals = finite_bytes(fmt, pad_to)
    d = vals.numel()
    kvals = decoded(fmt, vals).double() * (k_scale if fmt != "int8" else 1.0)
    k_rows = with_row_scale(fmt, torch.stack([vals, torch.zeros_like(vals)]).view(2, 1, d))
    one = {"int8": 1, "e4m3": 0x38, "e5m2": 0x3C}[fmt]  # 1.0 in each format
    v = torch.zeros(2, 1, dv, dtype=torch.uint8)
    v[0, 0, 0] = v[1, 0, 1] = one
    kst, vst = one_store(k_rows, device), one_store(with_row_scale(fmt, v), device)
    c = torch.where(kvals != 0, torch.exp2(torch.round(torch.log2(32.0 / kvals.abs().clamp_min(1e-30)))), 1.0)
    q = torch.diag(c).float().unsqueeze(0).to(device)  # [1 sequence, d heads, d dims]
    out = torch.full((1, d, dv), float("nan"), device=device)
    p, keep = make_params(fmt, q, out, kst, vst, Lengths([2], [0]), 2, dv, 1.0, k_scale, 1.0)
    p.num_kv_heads = 1
    expected = c * kvals
    for label in run(p, out):
        o = out[0].double().cpu()
        got = torch.log(o[:, 0]) - torch.log(o[:, 1])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, label=label: f"{label}: {m}")


def cpu_runner(p, out):
    for isa in ISAS:
        out.fill_(float("nan"))
        _C.decode_cpu(p, 1, isa)
        yield isa


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_byte_value_decodes_exactly(fmt):
    """Every finite byte of each format, subnormals included, through V (bit-exact) and K (scores)."""
    exhaustive_v(fmt, 1.0, "cpu", cpu_runner)
    exhaustive_k(fmt, 1.0, "cpu", cpu_runner)
    if fmt != "int8":
        exhaustive_v(fmt, 0.3125, "cpu", cpu_runner)
        exhaustive_k(fmt, 0.046875, "cpu", cpu_runner)


def bad_params():
    q = torch.zeros(1, 2, 64)
    out = torch.zeros(1, 2, 64)
    buf = torch.zeros(4 * 2 * 68, dtype=torch.uint8)
    p = _C.DecodeParams()
    p.num_seqs, p.num_heads, p.num_kv_heads, p.head_dim = 1, 2, 2, 64
    p.dtype, p.kv_dtype = 0, 3
    p.q, p.out, p.k, p.v = q.data_ptr(), out.data_ptr(), buf.data_ptr(), buf.data_ptr()
    lens = torch.tensor([4], dtype=torch.int32)
    slots = torch.tensor([0], dtype=torch.int32)
    p.lengths, p.slots, p.max_tokens = lens.data_ptr(), slots.data_ptr(), 4
    p.token_stride, p.head_stride, p.slot_stride = 2 * 68, 68, 0
    return p, (q, out, buf, lens, slots)


def test_bad_inputs_are_refused():
    p, keep = bad_params()
    _C.decode_check(p)
    _C.decode_cpu(p, 1)  # the valid baseline runs
    assert p.kv_dtype == 3 and p.k_scale == 1.0 and p.v_scale == 1.0
    p.dtype = 2  # quantized K/V with bf16 q
    with pytest.raises(InvalidArgumentError, match="float32"):
        _C.decode_cpu(p, 1)
    p.dtype, p.kv_dtype = 0, 7
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        _C.decode_check(p)
    p.kv_dtype = 1  # a 16-bit storage type under float32 q: not a supported pair
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        _C.decode_check(p)
    p.kv_dtype = 3
    p.head_stride = 67  # int8 head row: 64 values + 4 scale bytes
    with pytest.raises(InvalidArgumentError, match=r"head_stride .*\+ 4"):
        _C.decode_cpu(p, 1)
    p.head_stride, p.token_stride = 68, 2 * 68 - 1  # dense heads: tokens would overlap
    with pytest.raises(InvalidArgumentError, match="token_stride"):
        _C.decode_check(p)
    p.token_stride, p.v_head_stride = 2 * 68, 64  # V's footprint too
    with pytest.raises(InvalidArgumentError, match="V head_stride"):
        _C.decode_check(p)
    p.v_head_stride = 0
    _C.decode_check(p)  # 0: as K's (68)
    p.kv_dtype, p.head_stride, p.token_stride = 4, 64, 128
    p.k_scale = float("inf")
    with pytest.raises(InvalidArgumentError, match="finite"):
        _C.decode_check(p)
    p.k_scale = 0.5
    _C.decode_check(p)
    p.kv_dtype = -1  # as dtype: the float32 path
    _C.decode_check(p)


def test_int8_tiny_queries(rng):
    """Query heads from ordinary scales down to the subnormals (quantization steps below 2^-128, whose reciprocal
    is inf in float32): finite outputs within the contract on every path (the tiny heads near V's average)."""
    lengths = [70, 33]
    hkv, group, d = 2, 4, 128
    ks = [torch.randn(n, hkv, d, generator=rng) for n in lengths]
    vs = [torch.randn(n, hkv, d, generator=rng) for n in lengths]
    kq, vq = [quantize(k, "int8") for k in ks], [quantize(v, "int8") for v in vs]
    kst = Store([r for r, _ in kq], "dense", max(lengths), rng, slots=[0, 1])
    vst = Store([r for r, _ in vq], "dense", max(lengths), rng, slots=[0, 1])
    q = torch.randn(len(lengths), hkv * group, d, generator=rng)
    # per head a scale from ordinary to subnormal: 1, 2^-40, 2^-70, 2^-100, 2^-125, 2^-135, 2^-140, 2^-145
    q *= torch.tensor([2.0**-e for e in (0, 40, 70, 100, 125, 135, 140, 145)])[None, :, None]
    out = torch.full((len(lengths), hkv * group, d), float("nan"))
    scale = 1 / math.sqrt(d)
    p, keep = make_params("int8", q, out, kst, vst, Lengths(lengths, [0, 1]), max(lengths), d, scale, 1.0, 1.0)
    p.num_kv_heads = hkv
    ref = reference(q, [x for _, x in kq], [x for _, x in vq], scale)
    ref.int8_dot_bound = partial(int8_dot_bound, q, [x for _, x in kq], [x for _, x in vq], scale)
    run_cpu_all_isas(p, out, ref)


def test_isa_forcing_paths_agree(rng):
    """Forced paths give the same numbers up to fp32 rounding (int8 by integer products: within its contract), and
    a path the CPU lacks is refused."""
    p, keep, q, out, ref = case("int8", 4, 128, 128, "dense", rng, lengths=[600, 5])
    for isa in ("avx2", "avx512", "avx512bf16", "amx"):
        if isa not in ISAS:
            with pytest.raises(InvalidArgumentError, match="cannot run"):
                _C.decode_cpu(p, 1, isa)
    run_cpu_all_isas(p, out, ref)


# --------------------------------------------------------------------------------------------- write_kv
def test_write_kv_one_byte_rows(rng):
    """itemsize 1: quantized rows scattered as raw bytes (int8 rows are head_dim + 4 bytes wide)."""
    hkv, d, max_len, nslots = 2, 64, 40, 3
    w = d + 4
    for layout in ("dense", "padded", "head_major"):
        ss, ts, hs = strides_of(layout, hkv, w, max_len)
        extent = (nslots - 1) * ss + (max_len - 1) * ts + (hkv - 1) * hs + w
        kc, vc = garbage(extent, rng), garbage(extent, rng)
        before_k, before_v = kc.clone(), vc.clone()
        kview = kc.as_strided((nslots, max_len, hkv, w), (ss, ts, hs, 1))
        vview = vc.as_strided((nslots, max_len, hkv, w), (ss, ts, hs, 1))
        n = 9
        src_k = garbage(hkv * n * w, rng).view(hkv, n, w).transpose(0, 1)  # heads apart in memory
        src_v = garbage(n * hkv * w, rng).view(n, hkv, w)
        slots = torch.tensor([2, 0], dtype=torch.int32)
        lengths = torch.tensor([30, 40], dtype=torch.int32)
        rows = torch.tensor([0, 1, 1, 0, 1, 0, 1, 1, 0], dtype=torch.int32)
        pos = torch.tensor([0, 39, 3, 29, 0, 7, 20, 21, 8], dtype=torch.int32)
        p = _C.WriteKVParams()
        p.itemsize, p.num_rows, p.num_seqs, p.num_kv_heads, p.head_dim, p.v_head_dim = 1, n, 2, hkv, w, w
        p.k, p.v = src_k.data_ptr(), src_v.data_ptr()
        p.k_row_stride, p.k_head_stride = src_k.stride(0), src_k.stride(1)
        p.v_row_stride, p.v_head_stride = src_v.stride(0), src_v.stride(1)
        p.k_cache, p.v_cache = kc.data_ptr(), vc.data_ptr()
        p.slot_stride, p.token_stride, p.head_stride = ss, ts, hs
        p.v_slot_stride, p.v_token_stride, p.v_cache_head_stride = ss, ts, hs
        p.extent_lo, p.extent_hi = kc.data_ptr(), kc.data_ptr() + kc.numel()
        p.v_extent_lo, p.v_extent_hi = vc.data_ptr(), vc.data_ptr() + vc.numel()
        p.slots, p.lengths, p.rows, p.positions = slots.data_ptr(), lengths.data_ptr(), rows.data_ptr(), pos.data_ptr()
        _C.write_kv_cpu(p, 2)
        ek = before_k.clone().as_strided((nslots, max_len, hkv, w), (ss, ts, hs, 1))
        ev = before_v.clone().as_strided((nslots, max_len, hkv, w), (ss, ts, hs, 1))
        for i in range(n):
            ek[slots[rows[i]], pos[i]] = src_k[i]
            ev[slots[rows[i]], pos[i]] = src_v[i]
        assert torch.equal(kview, ek) and torch.equal(vview, ev), layout
        # Bytes outside the written rows are untouched (the views above cover only head rows).
        mask = torch.zeros(extent, dtype=torch.bool)
        mask.as_strided((nslots, max_len, hkv, w), (ss, ts, hs, 1))[:] = True
        assert torch.equal(kc[~mask], before_k[~mask]), layout
        # A bad row writes nothing.
        snap = kc.clone()
        pos[3] = 30  # sequence 0 holds 30 tokens
        with pytest.raises(InvalidArgumentError):
            _C.write_kv_cpu(p, 1)
        assert torch.equal(kc, snap)
    p.itemsize = 3
    with pytest.raises(InvalidArgumentError, match="itemsize"):
        _C.write_kv_cpu(p, 1)


# --------------------------------------------------------------------------------------------- CUDA
def cuda_launch(p, max_len, split_tokens):
    launch = _C.CudaLaunch()
    launch.device = torch.cuda.current_device()
    launch.stream = torch.cuda.current_stream().cuda_stream
    launch.num_splits = -(-max_len // split_tokens)
    launch.split_tokens = split_tokens
    bufs = ()
    if launch.num_splits > 1:
        acc = torch.empty(p.num_seqs, p.num_heads, launch.num_splits, p.v_head_dim, device="cuda")
        ml = torch.empty(p.num_seqs, p.num_heads, launch.num_splits, 2, device="cuda")
        launch.partial_acc, launch.partial_ml = acc.data_ptr(), ml.data_ptr()
        bufs = (acc, ml)
    return launch, bufs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="torch.cuda is not available (no CUDA GPU)")
@pytest.mark.parametrize("kind", ["dense", "head_major", "paged16"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256), (192, 128)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda(fmt, group, dims, kind, rng):
    """One pass and split over 256-token pieces on the same storage: one CPU reference serves both (the
    reference, not the kernel, is what costs time in this grid)."""
    paged = int(kind.removeprefix("paged")) if kind.startswith("paged") else 0
    layout = "dense" if paged else kind
    p, keep, q, out, ref = case(fmt, group, *dims, layout, rng, paged_block=paged, device="cuda")
    max_len = max(LENGTHS)
    for split in (max_len, 256):
        launch, bufs = cuda_launch(p, max_len, split)
        out.fill_(float("nan"))
        _C.decode_cuda(p, launch)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"split {split}"
        torch.testing.assert_close(out.cpu().double(), ref, **TOL, msg=lambda m, s=split: f"split {s}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="torch.cuda is not available (no CUDA GPU)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_every_byte_value_decodes_exactly(fmt):
    """As on the CPU, with the head dims the CUDA kernels compile (256, the finite values padded with zeros)."""

    def run(p, out):
        launch, bufs = cuda_launch(p, p.max_tokens, p.max_tokens)
        out.fill_(float("nan"))
        _C.decode_cuda(p, launch)
        torch.cuda.synchronize()
        yield "cuda"

    exhaustive_v(fmt, 0.3125, "cuda", run, pad_to=256)
    exhaustive_k(fmt, 0.046875, "cuda", run, pad_to=256, dv=256)
