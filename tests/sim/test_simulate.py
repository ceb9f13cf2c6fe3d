"""Memory accounting (stats breakdown), the accounting backend, and `vpaged simulate`."""

from __future__ import annotations

import json
import random

import pytest
import torch

import vpaged
from vpaged import KVGeometry, PagedCacheConfig, PagedKVCache, PagePool, VirtualCacheConfig, VirtualKVCache
from vpaged.cli import main as cli_main
from vpaged.errors import InvalidArgumentError, OutOfPagesError
from vpaged.kvcache.accounting import page_fill
from vpaged.sim import (
    CacheKind,
    SimConfig,
    SimRequest,
    TraceError,
    builtin_trace,
    kind_names,
    load_csv,
    make_kind,
    make_policy,
    model_shape,
    simulate,
)
from vpaged.sim.kinds import StaticSlots

PAGE = 4096
# 2 layers, 2 KV heads of 16 fp32: 128 bytes per token in a per_layer region (32 tokens per 4 KiB page),
# 512 bytes of K and V per token over all layers.
GEOM = KVGeometry(2, 2, 16, torch.float32)
BPT = 512
TB = 128


def _cache(accounting=False, layout="per_layer", pages=256, **kw):
    pool = PagePool("cpu", capacity_pages=pages, page_size=PAGE, accounting_only=accounting)
    return VirtualKVCache(GEOM, VirtualCacheConfig(max_seqs=8, max_seq_len=256, layout=layout, **kw), pool=pool)


def test_page_fill_keeps_the_fullest_use_of_a_shared_page():
    assert page_fill([], []) == {}
    assert page_fill([3, 1, 3, 2], [10, 5, 7, 0]) == {1: 5, 2: 0, 3: 10}


def test_breakdown_by_hand_private_forked_and_dormant():
    with _cache() as c:
        s = c.allocate()
        c.extend(s, 40)  # 2 pages in each of 4 regions; the second holds 8 of 32 tokens
        st = c.stats()
        assert (st.stored_bytes, st.fragmentation_bytes, st.reserved_bytes, st.dormant_bytes) == (
            40 * BPT,
            8 * PAGE - 40 * BPT,
            0,
            0,
        )
        assert st.waste_bytes == 8 * PAGE - 40 * BPT
        child = c.fork(s)  # shares all 8 pages: nothing new is stored
        st = c.stats()
        assert (st.stored_bytes, st.fragmentation_bytes) == (40 * BPT, 8 * PAGE - 40 * BPT)
        assert st.live_bytes == 80 * BPT  # per-sequence view counts both
        c.extend(child, 1)  # copy-on-write of the 4 last pages: the child's hold 9 tokens each
        st = c.stats()
        stored = 4 * PAGE + 4 * 8 * TB + 4 * 9 * TB
        assert (st.stored_bytes, st.fragmentation_bytes) == (stored, 12 * PAGE - stored)
        c.free(child)  # shares pages with s: unmapped at once
        c.free(s)  # private pages: kept for reuse
        st = c.stats()
        assert (st.stored_bytes, st.fragmentation_bytes, st.dormant_bytes) == (0, 0, 8 * PAGE)


def test_breakdown_counts_prefix_cache_pages_as_dormant():
    with _cache() as c:
        tokens = list(range(64))
        s = c.allocate(tokens=tokens)
        c.extend(s, 64)
        assert c.cache_prefix(s, tokens) == 64
        c.free(s)
        st = c.stats()
        assert st.stored_bytes == 0 and st.dormant_bytes == 8 * PAGE  # 2 full pages x 4 regions
        t = c.allocate(tokens=tokens + [7])  # a hit maps the cached pages: live again
        assert c.seq_len(t) == 64
        st = c.stats()
        assert st.stored_bytes == 64 * BPT and st.fragmentation_bytes == 0 and st.dormant_bytes == 0


def test_paged_cache_breakdown_by_hand():
    c = PagedKVCache(GEOM, PagedCacheConfig(max_seqs=4, max_seq_len=256, num_blocks=16, block_size=16))
    s = c.allocate()
    c.extend(s, 40)
    st = c.stats()
    assert (st.stored_bytes, st.fragmentation_bytes, st.reserved_bytes, st.dormant_bytes) == (40 * BPT, 8 * BPT, 0, 0)
    assert st.waste_bytes == 8 * BPT


def test_static_slots_breakdown_by_hand():
    shape = model_shape("2x2x16:fp32")
    assert shape.bytes_per_token == BPT
    p = StaticSlots(shape, budget_bytes=3 * 100 * BPT + 5, max_seq_len=100)
    assert p.slots == 3
    a = p.admit(SimRequest(0, 40, 5), 40)
    b = p.admit(SimRequest(0, 10, 5, n=2), 10)
    assert a is not None and b is not None
    assert p.admit(SimRequest(0, 10, 5), 10) is None  # 3 slots taken
    bd = p.breakdown()
    assert (bd.stored_bytes, bd.reserved_bytes, bd.fragmentation_bytes) == (60 * BPT, 240 * BPT, 0)


def test_accounting_backend_refuses_views_kernels_and_data():
    with _cache(accounting=True) as c:
        s = c.allocate()
        c.extend(s, 10)
        for call in (
            lambda: c.kv(0, s),
            lambda: c.new_kv(0, s),
            lambda: c.batch(0, [s]),
            lambda: c.write(0, s, torch.zeros(10, 2, 16), torch.zeros(10, 2, 16)),
        ):
            with pytest.raises(InvalidArgumentError, match="accounting"):
                call()
        assert c.seq_len(s) == 10  # nothing changed
    p = PagedKVCache(GEOM, PagedCacheConfig(max_seqs=2, max_seq_len=64, num_blocks=4, accounting_only=True))
    s = p.allocate()
    p.extend(s, 3)
    with pytest.raises(InvalidArgumentError, match="accounting"):
        p.kv(0, s)
    with pytest.raises(InvalidArgumentError, match="accounting"):
        vpaged.ops.decode_attention(torch.zeros(1, 2, 16), p, [s], 0)


def test_accounting_backend_runs_at_gpu_scale():
    # 80 GiB of 2 MiB pages, Llama-3-8B geometry: far beyond this machine's memory and mappings.
    pool = PagePool("cpu", capacity_bytes=80 << 30, page_size=2 << 20, accounting_only=True)
    with pytest.raises(InvalidArgumentError, match="host object"):
        PagePool("cuda", capacity_bytes=1 << 30, accounting_only=True)
    with VirtualKVCache(
        KVGeometry(32, 8, 128, torch.bfloat16),
        VirtualCacheConfig(max_seqs=1024, max_seq_len=4096, layout="interleaved"),
        pool=pool,
    ) as c:
        seqs = c.allocate_many(600)
        c.extend_many(seqs, 1000)  # 600 x 1000 tokens x 128 KiB = 73 GiB
        st = c.stats()
        assert st.stored_bytes == 600 * 1000 * (128 << 10)
        assert st.mapped_bytes == 600 * 63 * (2 << 20)  # 1000 tokens need 63 pages of 16 tokens
        with pytest.raises(OutOfPagesError):
            c.extend_many(seqs, 100)
        assert c.stats().mapped_bytes == st.mapped_bytes


def _apply(c, op, live, pick, count):
    """One operation on cache c; returns what it returned or the error class name."""
    try:
        seq = live[pick % len(live)] if live else None
        if op == "alloc":
            return c.allocate()
        if op == "alloc_prefix":
            return c.allocate(tokens=list(range(count + 40)))
        if seq is None:
            return "no sequence"
        if op == "extend":
            return c.extend(seq, count)
        if op == "fork":
            return c.fork(seq)
        if op == "free":
            return c.free(seq)
        if op == "cache_prefix":
            return c.cache_prefix(seq, list(range(c.seq_len(seq))))
        if op == "truncate":
            return c.truncate(seq, c.seq_len(seq) // 2)
        raise AssertionError(op)
    except vpaged.VPagedError as e:
        return type(e).__name__


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "head_major"])
def test_accounting_and_host_backends_account_identically(layout):
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    host, acct = _cache(layout=layout, pages=120), _cache(accounting=True, layout=layout, pages=120)
    live: list[int] = []
    ops = ["alloc", "alloc_prefix", "extend", "extend", "extend", "fork", "free", "cache_prefix", "truncate"]
    errors = 0
    for _ in range(300):
        op, pick, count = rnd.choice(ops), rnd.randrange(1 << 16), rnd.randrange(1, 60)
        a, b = _apply(host, op, live, pick, count), _apply(acct, op, live, pick, count)
        assert a == b, (op, a, b, seed)
        errors += isinstance(a, str)
        if op in ("alloc", "alloc_prefix", "fork") and isinstance(a, int):
            live.append(a)
        if op == "free" and a is None:
            live.remove(live[pick % len(live)])
        assert host.stats() == acct.stats(), (op, seed)
    assert errors > 0  # the run reached the budget (OutOfPages) and other refusals, not only easy paths
    host.close()
    acct.close()


def test_builtin_traces_follow_the_published_means():
    for name, (mean_in, mean_out) in {"sharegpt": (161, 338), "alpaca": (19, 58)}.items():
        trace = builtin_trace(name, 20000, float("inf"), 4096, seed=1)
        got_in = sum(r.prompt_len for r in trace) / len(trace)
        got_out = sum(r.output_len for r in trace) / len(trace)
        assert abs(got_in - mean_in) / mean_in < 0.08, (name, got_in)
        assert abs(got_out - mean_out) / mean_out < 0.08, (name, got_out)
        assert all(r.prompt_len + r.output_len <= 4096 and r.arrival == 0 for r in trace)
    with pytest.raises(TraceError, match="unknown trace"):
        builtin_trace("nope", 10, 1.0, 4096)


def test_csv_trace_errors_name_the_row(tmp_path):
    good = tmp_path / "t.csv"
    good.write_text("arrival,prompt_len,output_len,prefix_id,n\n0.5,10,4,,1\n0,20,3,7,2\n")
    trace = load_csv(good, 64, default_prefix_len=8)
    assert [(r.arrival, r.prompt_len, r.prefix_id, r.prefix_len, r.n) for r in trace] == [
        (0.0, 20, 7, 8, 2),
        (0.5, 10, None, 0, 1),
    ]
    cases = {
        "arrival,prompt_len\n1,2\n": "missing output_len",
        "arrival,prompt_len,output_len,colour\n0,1,1,red\n": "unknown column",
        "arrival,prompt_len,output_len\n0,ten,1\n": ":2: prompt_len must be an integer",
        "arrival,prompt_len,output_len\n0,1,1\n-1,1,1\n": ":3: arrival must be",
        "arrival,prompt_len,output_len\n0,60,10\n": "exceeds max_seq_len",
        "arrival,prompt_len,output_len\n": "no requests",
    }
    for text, message in cases.items():
        bad = tmp_path / "bad.csv"
        bad.write_text(text)
        with pytest.raises(TraceError, match=message):
            load_csv(bad, 64)


def _cfg(budget_tokens, max_seq_len=64):
    shape = model_shape("2x2x16:fp32")
    return SimConfig(shape, budget_tokens * shape.bytes_per_token, max_seq_len=max_seq_len, max_seqs=64)


def test_simulate_small_trace_by_hand():
    trace = [SimRequest(0.0, 10, 3), SimRequest(0.0, 20, 3)]
    cfg = _cfg(budget_tokens=1024)
    r = simulate(make_policy("block 16", cfg), trace, samples=10)
    assert (r.finished, r.steps, r.peak_running, r.preemptions, r.dropped) == (2, 3, 2, 0, 0)
    first = r.samples[0].breakdown  # after step 0: lengths 11 and 21 in blocks of 16
    assert (first.stored_bytes, first.fragmentation_bytes) == (32 * BPT, (16 + 32 - 32) * BPT)
    assert r.samples[-1].breakdown.held_bytes == 0
    s = simulate(make_policy("static", cfg), trace, samples=10)
    first = s.samples[0].breakdown
    assert (first.stored_bytes, first.reserved_bytes) == (32 * BPT, (2 * 64 - 32) * BPT)


def test_simulate_preempts_and_still_finishes_everything():
    trace = builtin_trace("alpaca", 60, float("inf"), 64, seed=3)
    cfg = _cfg(budget_tokens=700)
    for name in ("block 16", "vpaged interleaved 4 KiB"):
        r = simulate(make_policy(name, cfg), trace, samples=20)
        assert r.finished + r.dropped == 60 and r.unfinished == 0, name
        assert r.preemptions > 0, name
        assert max(s.breakdown.held_bytes for s in r.samples) <= cfg.budget_bytes


def test_sharing_policies_hold_less():
    trace = builtin_trace("alpaca", 40, float("inf"), 256, seed=2, shared_prefix=128, n=4)
    cfg = _cfg(budget_tokens=1 << 20, max_seq_len=256)
    held = {}
    for name in ("block 16", "block 16 +share", "vpaged interleaved 4 KiB", "vpaged interleaved 4 KiB +share"):
        r = simulate(make_policy(name, cfg), trace, samples=50)
        assert r.finished == 40
        held[name] = r.peak_held_bytes
    assert held["block 16 +share"] < held["block 16"] / 3
    assert held["vpaged interleaved 4 KiB +share"] < held["vpaged interleaved 4 KiB"] / 3


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(InvalidArgumentError, match="unknown policy"):
        make_policy("vpaged sideways", _cfg(100))


def test_cli_simulate_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sim.json"
    rc = cli_main(
        [
            "simulate",
            "--model",
            "2x2x16:fp32",
            "--budget-gib",
            "0.001",
            "--requests",
            "30",
            "--trace",
            "alpaca",
            "--max-seq-len",
            "256",
            "--rate",
            "inf",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
            "--policies",
            "static,block 16,vpaged per_layer 4 KiB",
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert [p["policy"] for p in data["policies"]] == ["static", "block 16", "vpaged per_layer 4 KiB"]
    for p in data["policies"]:
        assert p["finished"] + p["dropped"] == 30
        assert {"live_share", "waste_share", "dormant_share", "peak_running", "preemptions"} <= p.keys()
    for png in ("memory_over_time.png", "waste_by_cause.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt-9"], "unknown model shape"),
        (["--budget-gib", "-1"], "--budget-gib must be a positive number"),
        (["--policies", "block 64"], "block_size must be one of"),
        (["--trace", "missing.csv"], "cannot read trace"),
        (["--model", "Llama-3-70B", "--tensor-parallel-size", "3"], "must be positive and divide"),
    ],
)
def test_cli_simulate_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["simulate", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


def test_cli_simulate_one_rank_of_a_tensor_parallel_deployment(tmp_path):
    # A rank of TP 2 keeps half the KV heads: half the bytes per token, so the same budget holds twice the tokens.
    runs = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        argv = ["simulate", "--model", "2x4x16:fp32", "--budget-gib", "0.0005", "--requests", "30", "--trace"]
        argv += ["alpaca", "--max-seq-len", "256", "--rate", "inf", "--policies", "block 16", "--json", str(out)]
        assert cli_main([*argv, "--tensor-parallel-size", str(tp)]) == 0
        runs[tp] = json.loads(out.read_text())
    assert runs[2]["bytes_per_token"] * 2 == runs[1]["bytes_per_token"]
    assert runs[2]["tensor_parallel_size"] == 2 and "TP2 rank" in runs[2]["model"]
    assert runs[2]["policies"][0]["peak_running"] >= runs[1]["policies"][0]["peak_running"]


def test_cache_kinds_under_their_names_and_the_earlier_ones():
    cfg = _cfg(100)
    with pytest.raises(InvalidArgumentError, match="unknown cache kind 'vpaged sideways'"):
        make_kind("vpaged sideways", cfg)
    kind = make_kind("block 16", cfg)
    assert isinstance(kind, CacheKind) and kind.name == "block 16"
    kind.close()
    assert kind_names(sharing=False) == vpaged.sim.policy_names(sharing=False)


def test_cli_kinds_flag_is_the_policies_flag(tmp_path):
    outs = {}
    for flag in ("--kinds", "--policies"):
        out = tmp_path / f"{flag[2:]}.json"
        argv = ["simulate", "--model", "2x2x16:fp32", "--budget-gib", "0.0005", "--requests", "20", "--trace"]
        argv += ["alpaca", "--max-seq-len", "256", "--rate", "inf", flag, "static,block 16", "--json", str(out)]
        assert cli_main(argv) == 0
        data = json.loads(out.read_text())
        outs[flag] = [(p["policy"], p["finished"], p["peak_running"]) for p in data["policies"]]
    assert outs["--kinds"] == outs["--policies"] and [k for k, _, _ in outs["--kinds"]] == ["static", "block 16"]
