"""vpaged's vLLM KV connector (vpaged/integrations/vllm/connector/): its settings (no vLLM needed); its two
halves driven by vLLM's own Scheduler, Request and KV cache config classes (publish from one engine's buffer,
match and load into another's, a page lost between match and load recomputed through vLLM's invalid-block
path); and whole vLLM engines (test_vllm_connector_engine.py).

The vLLM tests skip where vllm is not importable (scripts/test_vllm.sh runs them in its venv)."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from vpaged.errors import InvalidArgumentError
from vpaged.integrations.vllm.connector import ConnectorSettings

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm is not installed (scripts/test_vllm.sh makes a venv with it)"
)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({}, "needs kv_connector_extra_config"),
        ({"store": ""}, "needs kv_connector_extra_config"),
        ({"store": "kv", "sotre_bytes": 1}, "does not know: ['sotre_bytes']"),
        ({"store": "kv", "store_bytes": 0}, "store_bytes is a positive int"),
        ({"store": "kv", "store_bytes": True}, "store_bytes is a positive int"),
        ({"store": "kv", "map": "yes"}, "map is true or false"),
        ({"store": "kv", "weights": 3}, "weights is a str"),
    ],
)
def test_settings_refuse_what_they_do_not_understand(extra, words):
    with pytest.raises(InvalidArgumentError, match=words.replace("[", r"\[").replace("]", r"\]")):
        ConnectorSettings.from_extra_config(extra)


def test_settings_defaults():
    s = ConnectorSettings.from_extra_config({"store": "dir:/tmp/x"})
    assert (s.store, s.store_bytes, s.weights, s.map_pages) == ("dir:/tmp/x", 4 << 30, "", True)


# ---- the two halves on vLLM's classes ----

BLOCK = 32
LAYERS = 3
HEADS, HEAD_DIM = 2, 16
NUM_BLOCKS = 40


@pytest.fixture
def store_name():
    from vpaged.memory.store import PageStore

    name = f"conn-test-{uuid.uuid4().hex[:8]}"
    yield name
    PageStore.remove(name)


def _configs(model_dir, store: str, role: str = "kv_both", policy: str = "recompute"):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    model_config = ModelConfig(model=str(model_dir), dtype="float32", seed=0, max_model_len=1024)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="VPagedConnector",
            kv_connector_module_path="vpaged.integrations.vllm.connector",
            kv_role=role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config={"store": store, "store_bytes": 8 << 20},
        ),
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    # Layer-outermost, as vLLM's CPU build lays its buffer out: layer i's block b at i * page * blocks + b * page.
    tensor = KVCacheTensor(
        size=page * NUM_BLOCKS * LAYERS, layers=names, layer_stride=page * NUM_BLOCKS, block_stride=page
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vllm_config, kv_cache_config


def _scheduler(vllm_config, kv_cache_config):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )


class Worker:
    """A worker's connector over a real buffer: vLLM's per-layer views of one byte buffer, filled at random."""

    def __init__(self, vllm_config, kv_cache_config, seed: int | None):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from vpaged.integrations.vllm.connector import VPagedConnector

        t = kv_cache_config.kv_cache_tensors[0]
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        self.buffer = (
            torch.randint(-128, 128, (t.size,), dtype=torch.int8, generator=g)
            if seed is not None
            else torch.zeros(t.size, dtype=torch.int8)
        )
        self.layer_stride, self.block_stride = t.layer_stride, t.block_stride
        self.page = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        self.connector = VPagedConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        views = {name: self.buffer[i * t.layer_stride : (i + 1) * t.layer_stride] for i, name in enumerate(t.layers)}
        self.connector.register_kv_caches(views)

    def block(self, block: int) -> list[bytes]:
        """The block's page in every layer (the reference, read straight from the buffer)."""
        out = []
        for layer in range(LAYERS):
            start = layer * self.layer_stride + block * self.block_stride
            out.append(self.buffer[start : start + self.page].numpy().tobytes())
        return out

    def step(self, meta):
        self.connector.bind_connector_metadata(meta)
        try:
            self.connector.start_load_kv(None)
            self.connector.wait_for_save()
        finally:
            self.connector.clear_connector_metadata()
        return self.connector.get_block_ids_with_load_errors()


def _request(req_id: str, prompt: list[int], max_tokens: int = 4):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)  # vLLM's own block hashes (its prefix cache), seeded as the engine seeds them
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _output(scheduler_output, invalid: set[int] | None = None, token: int = 7):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid or set()),
    )


def _engine_pair(model_dir, store, seed):
    vllm_config, kv_cache_config = _configs(model_dir, store)
    return _scheduler(vllm_config, kv_cache_config), Worker(vllm_config, kv_cache_config, seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    from test_vllm_plugin import _make_model

    out = tmp_path_factory.mktemp("connector_model")
    _make_model(str(out))
    return out


@needs_vllm
def test_blocks_published_by_one_engine_load_into_another_bit_exact(model_dir, store_name):
    import random

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    prompt = [rng.randrange(3, 512) for _ in range(BLOCK * 3 + rng.randrange(1, BLOCK))]  # 3 full blocks and a part
    s1, w1 = _engine_pair(model_dir, store_name, seed=rng.randrange(1 << 30))
    s1.add_request(_request("a", prompt))
    out = s1.schedule()
    meta = out.kv_connector_metadata
    assert meta.loads == [] and len(meta.saves) == 1 and len(meta.saves[0].block_ids) == 3
    assert w1.step(meta) == set()
    assert w1.connector.worker_side.stats.published_pages == 3 * LAYERS
    written = {b: w1.block(b) for b in meta.saves[0].block_ids}

    # A second engine (another scheduler, another store client, a zeroed buffer) with a longer prompt of the
    # same prefix: vLLM's own cache is empty, the store holds three blocks.
    s2, w2 = _engine_pair(model_dir, store_name, seed=None)
    longer = prompt + [rng.randrange(3, 512) for _ in range(BLOCK * 2)]
    s2.add_request(_request("b", longer))
    out2 = s2.schedule()
    assert out2.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK
    assert out2.num_scheduled_tokens["b"] == len(longer) - 3 * BLOCK
    (load,) = out2.kv_connector_metadata.loads
    assert w2.step(out2.kv_connector_metadata) == set()
    for src, dst in zip(meta.saves[0].block_ids, load.block_ids):
        assert w2.block(dst) == written[src]
    # The new blocks of b (its 4th and 5th, computed this step) are published; the loaded ones are not again.
    (save,) = out2.kv_connector_metadata.saves
    assert len(save.block_ids) == (len(longer)) // BLOCK - 3
    assert w2.connector.worker_side.stats.copied_bytes == 3 * LAYERS * w2.page


@needs_vllm
def test_a_prompt_of_whole_blocks_leaves_its_last_token_to_compute(model_dir, store_name):
    s1, w1 = _engine_pair(model_dir, store_name, seed=1)
    prompt = list(range(3, 3 + 2 * BLOCK))
    s1.add_request(_request("a", prompt))
    w1.step(s1.schedule().kv_connector_metadata)
    s2, _ = _engine_pair(model_dir, store_name, seed=None)
    s2.add_request(_request("b", prompt))
    out = s2.schedule()
    # vLLM must compute a token to sample from: one block from the store, the second computed.
    assert out.scheduled_new_reqs[0].num_computed_tokens == BLOCK
    assert out.num_scheduled_tokens["b"] == BLOCK


@needs_vllm
def test_other_weights_never_match(model_dir, store_name):
    s1, w1 = _engine_pair(model_dir, store_name, seed=2)
    prompt = list(range(3, 3 + 3 * BLOCK + 5))
    s1.add_request(_request("a", prompt))
    w1.step(s1.schedule().kv_connector_metadata)
    vllm_config, kv_cache_config = _configs(model_dir, store_name)
    vllm_config.kv_transfer_config.kv_connector_extra_config["weights"] = "another-model@rev"
    s2 = _scheduler(vllm_config, kv_cache_config)
    s2.add_request(_request("b", prompt))
    out = s2.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0 and out.kv_connector_metadata.loads == []


@needs_vllm
def test_a_page_lost_between_match_and_load_is_recomputed(model_dir, store_name):
    from vpaged.memory.store import PageStore, page_key

    s1, w1 = _engine_pair(model_dir, store_name, seed=3)
    prompt = list(range(5, 5 + 3 * BLOCK + 9))
    s1.add_request(_request("a", prompt))
    meta = s1.schedule().kv_connector_metadata
    w1.step(meta)
    s2, w2 = _engine_pair(model_dir, store_name, seed=None)
    s2.add_request(_request("b", prompt))
    out = s2.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK
    (load,) = out.kv_connector_metadata.loads
    # Between the scheduler's match and the worker's load, the second block's layer-1 page is overwritten in
    # the store's data file: its checksum fails, the block and the one after it are not filled.
    with PageStore.open(store_name) as store:
        (handle,) = store.pin([page_key(load.block_keys[1], 1)])
        offset = handle.offset
        handle.release()
        path = store.data_path
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(64))
    failed = w2.step(out.kv_connector_metadata)
    assert failed == set(load.block_ids[1:])
    assert w2.connector.worker_side.stats.load_failures == 2
    assert w2.block(load.block_ids[0]) == w1.block(meta.saves[0].block_ids[0])
    # vLLM's scheduler takes the failure and computes from the first bad block on (policy "recompute").
    s2.update_from_output(out, _output(out, invalid=failed))
    request = s2.requests["b"]
    assert request.num_computed_tokens == BLOCK
    again = s2.schedule()
    assert again.num_scheduled_tokens["b"] == len(prompt) - BLOCK


@needs_vllm
def test_a_consumer_publishes_nothing_and_a_producer_loads_nothing(model_dir, store_name):
    prompt = list(range(7, 7 + 2 * BLOCK + 3))
    vc, kc = _configs(model_dir, store_name, role="kv_consumer")
    s, w = _scheduler(vc, kc), Worker(vc, kc, seed=4)
    s.add_request(_request("a", prompt))
    meta = s.schedule().kv_connector_metadata
    assert meta.saves == []
    w.step(meta)
    vp, kp = _configs(model_dir, store_name, role="kv_producer")
    p, pw = _scheduler(vp, kp), Worker(vp, kp, seed=5)
    p.add_request(_request("a", prompt))
    pw.step(p.schedule().kv_connector_metadata)
    p2 = _scheduler(vp, kp)
    p2.add_request(_request("b", prompt))
    out = p2.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # the producer's blocks are there; it does not load
    c2 = _scheduler(vc, kc)
    c2.add_request(_request("c", prompt))
    assert c2.schedule().scheduled_new_reqs[0].num_computed_tokens == 2 * BLOCK


@needs_vllm
def test_a_hybrid_model_is_declined_with_a_warning(model_dir, store_name, caplog):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from vpaged.integrations.vllm.connector import VPagedConnector
    from vpaged.memory.store import PageStore

    vllm_config, kv_cache_config = _configs(model_dir, store_name)
    swa = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32, sliding_window=64
    )
    hybrid = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=kv_cache_config.kv_cache_tensors,
        kv_cache_groups=[*kv_cache_config.kv_cache_groups, KVCacheGroupSpec(["model.layers.9.self_attn.attn"], swa)],
    )
    with caplog.at_level("WARNING"):
        c = VPagedConnector(vllm_config, KVConnectorRole.SCHEDULER, hybrid)
    assert c.store is None and "does nothing for this engine" in caplog.text
    assert not PageStore.exists(store_name)  # declined before it made a store


@needs_vllm
def test_another_vllm_version_is_refused(model_dir, store_name, monkeypatch):
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vpaged.errors import VersionUnsupportedError
    from vpaged.integrations.vllm.connector import VPagedConnector

    vllm_config, kv_cache_config = _configs(model_dir, store_name)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(VersionUnsupportedError, match="this is vLLM 0.99.0"):
        VPagedConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def _finish(scheduler, out):
    """Feed one sampled token back; the kv_transfer_params of every request that finished with it."""
    done = {}
    for client_outputs in scheduler.update_from_output(out, _output(out)).values():
        for o in client_outputs.outputs:
            if o.finish_reason is not None:
                done[o.request_id] = o.kv_transfer_params
    return done


@needs_vllm
@pytest.mark.parametrize("tail", [0, 11])  # a prompt of whole blocks, and one whose last block is not full
def test_a_prefill_hands_its_whole_prompt_to_a_decode_instance(model_dir, store_name, tail):
    import random

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    prompt = [rng.randrange(3, 512) for _ in range(BLOCK * 3 + tail)]
    vp, kp = _configs(model_dir, store_name, role="kv_producer")
    prefill, pw = _scheduler(vp, kp), Worker(vp, kp, seed=rng.randrange(1 << 30))
    request = _request("p", prompt, max_tokens=1)
    request.kv_transfer_params = {"do_remote_decode": True}
    prefill.add_request(request)
    out = prefill.schedule()
    (save,) = out.kv_connector_metadata.saves
    assert len(save.block_ids) == 3 + (tail > 0)  # the partial last block too
    pw.step(out.kv_connector_metadata)
    written = [pw.block(b) for b in save.block_ids]
    params = _finish(prefill, out)["p"]
    assert params["do_remote_prefill"] is True and params["vpaged_store"] == store_name

    vc, kc = _configs(model_dir, store_name, role="kv_consumer")
    decode, dw = _scheduler(vc, kc), Worker(vc, kc, seed=None)
    request = _request("d", prompt)
    request.kv_transfer_params = params
    decode.add_request(request)
    out = decode.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == len(prompt) - 1  # the prefill's, all but one token
    assert out.num_scheduled_tokens["d"] == 1
    (load,) = out.kv_connector_metadata.loads
    assert load.last_written and len(load.block_ids) == len(written)
    assert dw.step(out.kv_connector_metadata) == set()
    assert [dw.block(b) for b in load.block_ids] == written
    assert decode.connector.scheduler_side.stats.handoffs_in == 1

    # The same prompt without the hand-off's params is a plain hit: full blocks only, the last one computed.
    plain = _scheduler(vc, kc)
    plain.add_request(_request("x", prompt))
    assert plain.schedule().scheduled_new_reqs[0].num_computed_tokens == (len(prompt) - 1) // BLOCK * BLOCK


@needs_vllm
def test_a_decode_request_whose_prefill_pages_are_gone_computes_them(model_dir, store_name):
    prompt = list(range(9, 9 + 2 * BLOCK + 5))
    vc, kc = _configs(model_dir, store_name, role="kv_consumer")
    decode = _scheduler(vc, kc)
    request = _request("d", prompt)
    request.kv_transfer_params = {"do_remote_prefill": True, "do_remote_decode": False}
    decode.add_request(request)
    out = decode.schedule()  # nothing was published: it computes the prompt, it does not wait
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens["d"] == len(prompt)
