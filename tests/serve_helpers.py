"""Helpers of the server and CLI tests: a random-weight model saved with a small local tokenizer (no network),
a greedy reference from transformers' own generate() (the one-thread fixture is in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

WORDS = (
    "the a an of to in on with and or but if then so because cat dog bird fish tree house river stone "
    "light dark red blue green small large quick slow old new runs jumps sees eats finds makes holds "
    "gives takes sleeps sings over under near far here there now later today always never"
).split()


def option_of(config, name: str):
    """The flat option `name` of an EngineConfig, read from the part that holds it (the config has no
    flat attributes: each option is read as config.<part>.<name>)."""
    for part in ("store", "scheduler", "model", "parallel"):
        held = getattr(config, part)
        if name in held.__dataclass_fields__:
            return getattr(held, name)
    return getattr(config, name)  # seed, record_steps: EngineConfig's own


# Renders a conversation as plain words the word-level tokenizer knows ("user : hello dog assistant :").
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def word_tokenizer(vocab_size: int, chat_template: str | None = CHAT_TEMPLATE):
    """A word-level PreTrainedTokenizerFast with exactly `vocab_size` ids, so that every id a random model
    can generate decodes to a word: special tokens, punctuation, WORDS, then filler words w0, w1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<pad>", "<s>", "</s>", "<unk>", ":", ".", ",", "?", "system", "user", "assistant", *WORDS]
    names = list(dict.fromkeys(names))
    names += [f"w{i}" for i in range(vocab_size - len(names))]
    assert len(names) >= vocab_size, "vocab too small for the fixed words"
    names = names[:vocab_size]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def save_model_with_tokenizer(path, spec: str = "random:llama-tiny", chat_template: str | None = CHAT_TEMPLATE):
    """Save a random-weight model and a word tokenizer matching its vocabulary to `path`; returns the model."""
    from vpaged.serve import load_model

    model, _ = load_model(spec, dtype=torch.float32)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    tok = word_tokenizer(vocab, chat_template)
    model.config.eos_token_id = tok.eos_token_id
    model.config.bos_token_id = tok.bos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def tiny_engine_and_reference(kv_budget_bytes: int = 8 << 20):
    """(LLM, model): an engine on random:llama-tiny and the same seeded weights on SDPA, to check the engine's
    tokens against a step-by-step forward; torch on one thread. Skips where transformers is missing or its
    release cannot serve."""
    pytest.importorskip("transformers")
    from vpaged.hf.compat import serving_support
    from vpaged.serve import LLM, load_model

    ok, why = serving_support()
    if not ok:
        pytest.skip(why)
    torch.set_num_threads(1)
    reference = load_model("random:llama-tiny")[0]
    reference.set_attn_implementation("sdpa")
    return LLM("random:llama-tiny", kv_budget_bytes=kv_budget_bytes), reference


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of the plain transformers forward with its DynamicCache, one request, EOS neither stopping
    nor suppressed (as with ignore_eos); and the top-2 logit gap at each step (a mismatch where the gap is
    tiny is a tie that float rounding may break either way)."""
    from transformers import DynamicCache

    from vpaged.hf import cache_kwargs

    model.set_attn_implementation("sdpa")  # the reference never runs the engine's attention
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    tokens, gaps = [], []
    for _ in range(max_new_tokens):
        # The cache keyword of the installed release: before 5.24 a `cache=` lands unread in the model's
        # **kwargs, and each forward would start from a fresh cache (a wrong reference, not an error).
        logits = model(input_ids=ids, use_cache=True, **cache_kwargs(cache)).logits[0, -1].float()
        assert cache.get_seq_length() == len(prompt) + len(tokens), "the reference's cache was not used"
        top = torch.topk(logits, 2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        ids = top.indices[:1].view(1, 1)
    return tokens, gaps


def assert_greedy_matches(got: list[int], prompt: list[int], model, max_new_tokens: int, tol: float = 1e-4):
    ref, gaps = greedy_reference(model, prompt, max_new_tokens)
    assert len(got) == len(ref), (got, ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert gaps[i] < tol, f"token {i}: got {a}, reference {b} (top-2 gap {gaps[i]:.2e})"
            return  # past a tie the sequences legitimately diverge


def record_logits(engine) -> list:
    """The logits of every step the engine runs from now on (its runner's forward, wrapped)."""
    seen = []
    inner = engine.runner.forward

    def forward(inputs, step):
        out = inner(inputs, step)
        seen.append(out.detach().clone())
        return out

    engine.runner.forward = forward
    return seen


def run_lockstep(a, b, requests) -> tuple[list, list]:
    """The same requests ((prompt, SamplingParams) each) added to engines a and b, stepped alternately to the
    end: the logits of each one's steps."""
    seen_a, seen_b = record_logits(a), record_logits(b)
    for engine in (a, b):
        for prompt, params in requests:
            engine.add_request(prompt, params)
    while a.has_unfinished() or b.has_unfinished():
        a.step()
        b.step()
    return seen_a, seen_b


def assert_logits_agree(seen_a, seen_b, dtype) -> None:
    """Step by step, the same shapes and logits within the dtype's share of the largest (fp32 2e-5, bf16 4e-2)."""
    assert len(seen_a) == len(seen_b) >= 2
    for got, want in zip(seen_a, seen_b):
        assert got.shape == want.shape
        if got.numel() == 0:
            continue
        scale = want.double().abs().max().item()
        tol = 2e-5 if dtype == torch.float32 else 4e-2
        assert (got.double() - want.double()).abs().max().item() <= tol * scale
