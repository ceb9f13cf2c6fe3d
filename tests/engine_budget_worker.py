"""An engine process in a shared budget that keeps submitting requests (tests/serve/test_shared_budget_fair.py).

    python engine_budget_worker.py BUDGET SEED MAX_TOKENS

random:llama-tiny, ceiling = the budget's capacity. Prints {"ready": pid} once loaded, then keeps at least
BACKLOG requests waiting (prompts drawn from SEED) and steps, until a line arrives on stdin; then stops
submitting, finishes what it accepted, and prints one JSON line: every request's prompt and output tokens,
how many were submitted, and the most pages its pool held at once.
"""

import json
import os
import random
import select
import sys

import torch

from vpaged.memory import SharedBudget
from vpaged.serve import LLMEngine, SamplingParams, load_model

BACKLOG = 4


def main() -> None:
    name, seed, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    model, tok = load_model("random:llama-tiny", dtype=torch.float32)
    capacity = SharedBudget.open(name).capacity_bytes
    engine = LLMEngine(
        model, tok, kv_budget_bytes=capacity, shared_budget=name, max_num_seqs=32, max_model_len=512, cpu_prepack=False
    )
    pool = engine.store.cache.pool
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts, outputs, most_pages = {}, {}, 0
    print(json.dumps({"ready": os.getpid()}), flush=True)
    stopping = False
    while True:
        if not stopping and select.select([sys.stdin], [], [], 0)[0]:
            sys.stdin.readline()
            stopping = True
        while not stopping and len(engine.scheduler.waiting) < BACKLOG:
            rid = f"a{len(prompts)}"
            prompts[rid] = [rng.randrange(10, 500) for _ in range(rng.randint(40, 200))]
            engine.add_request(prompts[rid], params, request_id=rid)
        if stopping and not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        most_pages = max(most_pages, pool.stats().used_pages)
    print(json.dumps({"submitted": len(prompts), "prompts": prompts, "outputs": outputs, "most_pages": most_pages}))
    engine.close()


if __name__ == "__main__":
    main()
