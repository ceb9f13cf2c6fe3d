"""generate() with a VPagedCache on a small randomly initialized Llama (nothing is downloaded).

    python examples/hf_generate.py

Runs on every supported transformers release: `cache_kwargs(cache)` hands the cache over under the keyword
the installed release expects (`cache=` from 5.24, `past_key_values=` before).

Prints the generated ids (checked against transformers' DynamicCache) and the KV memory vpaged mapped,
next to what a StaticCache of the same max_cache_len would allocate.
"""

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from vpaged.hf import VPagedCache, cache_kwargs

MAX_CACHE_LEN = 4096  # what the application allows; vpaged maps pages only for the tokens that arrive


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def report(title: str, cache: VPagedCache, batch: int) -> None:
    pool = cache.pool.stats()
    static = cache.static_bytes(batch_size=batch)
    print(f"  {title}: {cache}")
    print(
        f"    vpaged KV memory now {mib(pool.used_bytes)}, peak {mib(pool.high_water_bytes)} "
        f"({cache.stats().tokens_per_page:g} tokens per page of each page run)"
    )
    print(
        f"    StaticCache(max_cache_len={MAX_CACHE_LEN}) for {batch} rows: {mib(static)} "
        f"= {static / max(pool.high_water_bytes, 1):.0f}x vpaged's peak"
    )


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1000,
        max_position_embeddings=MAX_CACHE_LEN,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0

    # Three prompts of different lengths, left-padded into one batch.
    lengths = [24, 9, 17]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(2, config.vocab_size, (n,))
        mask[row, -n:] = 1

    print("greedy, batch of 3 left-padded prompts, 48 new tokens")
    cache = VPagedCache(config, max_cache_len=MAX_CACHE_LEN, capacity_bytes=256 << 20)
    out = model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=48, do_sample=False)
    ref = model.generate(
        ids, attention_mask=mask, **cache_kwargs(DynamicCache(config=config)), max_new_tokens=48, do_sample=False
    )
    for row in out[:, ids.shape[1] :]:
        print("   ", row.tolist())
    print(f"  same tokens as DynamicCache: {torch.equal(out, ref)}")
    report("after generate", cache, batch=len(lengths))
    cache.reset()
    print(f"  after reset(): {mib(cache.pool.stats().used_bytes)} in use")

    print("\nbeam search, 4 beams, one 300-token prompt, 24 new tokens")
    prompt = torch.randint(2, config.vocab_size, (1, 300))
    cache = VPagedCache(config, max_cache_len=MAX_CACHE_LEN, capacity_bytes=256 << 20)
    out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=24, num_beams=4, do_sample=False)
    ref = model.generate(
        prompt, **cache_kwargs(DynamicCache(config=config)), max_new_tokens=24, num_beams=4, do_sample=False
    )
    print("   ", out[0, prompt.shape[1] :].tolist())
    print(f"  same tokens as DynamicCache: {torch.equal(out, ref)}")
    tokens = 4 * (prompt.shape[1] + 23)
    print(
        f"  DynamicCache holds each beam's copy: {mib(tokens * cache.bytes_per_token())}; vpaged stores the "
        "prompt once and the beams share pages"
    )
    report("after generate", cache, batch=4)
    cache.close()


if __name__ == "__main__":
    main()
