"""The accuracy contract of int8 decode by integer products (VNNI dot products on avx512bf16, 16-bit products on
avx2) as a bound the tests check outputs against (shared by the kernel's tests and the caches' quantized-decode
tests)."""

import torch


def int8_dot_bound(q, ks, vs, scale, prob_steps):
    """The accuracy contract of int8 decode by integer products (csrc/kernels/decode_cpu_tiles.h, "Int8 scores by
    dot products"), per output element, from the dequantized K/V rows in float64: the query quantized per head moves
    a score by at most delta = 0.5 * (s_q / 254) * sum_i |k_i| (s_q the power-of-two step of its high byte), which
    moves the output by at most (e^(2 delta) - 1) * sum_t w_t |v_t|; probabilities quantized per chunk to
    prob_steps steps (a power-of-two step, < 2 max / prob_steps: 255 by VNNI, 32767 on avx2;
    _C.decode_cpu_int8_dot_prob_steps) move it by at most 1 / prob_steps * max_t (w_t * v row scale_t) * sum_t
    |v_t| / v row scale_t, times e^(2 delta) for the scores' own error (w: the exact softmax weights)."""
    assert prob_steps > 0, "the path takes fp32 products: no contract of its own"
    num_seqs, num_heads, head_dim = q.shape
    hkv = ks[0].shape[1]
    out = torch.empty(num_seqs, num_heads, vs[0].shape[-1], dtype=torch.float64)
    for i, (k, v) in enumerate(zip(ks, vs)):
        k, v = k.double(), v.double()  # [t, hkv, d]
        grouped = q[i].double().view(hkv, num_heads // hkv, head_dim) * scale
        amax = grouped.abs().amax(-1)  # [hkv, g]
        s_q = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-300) / 127))), 0.0)
        # the query's low byte leaves 0.5 / 254 of a step per dim; the fp32 sums of up to ~2^22 steps round to 4
        rk = k.abs().amax(-1) / 127  # [t, hkv]: the int8 K rows' scales
        delta = s_q * ((0.5 / 254) * k.abs().sum(-1) + 4 * rk).amax(0)[:, None]  # [hkv, g]
        w = torch.einsum("kgd,tkd->kgt", grouped, k).softmax(-1)  # [hkv, g, t]
        rs = v.abs().amax(-1) / 127  # [t, hkv]: the int8 rows' scales
        v_int = torch.where(rs[..., None] > 0, v / rs.clamp_min(1e-300)[..., None], torch.zeros_like(v))
        grow = torch.expm1(2 * delta)[..., None]
        score_part = grow * torch.einsum("kgt,tkd->kgd", w, v.abs())
        p_max = (w * rs.T[:, None, :]).amax(-1)  # [hkv, g]
        p_part = (1 / prob_steps) * (1 + grow) * p_max[..., None] * v_int.abs().sum(0)[:, None, :]
        out[i] = (score_part + p_part).reshape(num_heads, -1)
    return out


def assert_within_contract(out, exact, bound, atol, rtol, label):
    """out within the contract's bound of the float64 exact attention, widened by the caller's fp32 / bf16
    tolerance (the output's own rounding)."""
    allowed = bound + atol + rtol * exact.abs()
    worst = ((out.double() - exact).abs() / allowed).max().item()
    assert worst <= 1.0, f"{label}: int8 integer products off by {worst:.3f} of the contract's bound"
