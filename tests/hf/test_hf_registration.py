"""attn_implementation="vpaged" is usable after any of the imports a user writes (a fresh interpreter each),
and vpaged.hf.compat alone still does not import transformers (what `vpaged info` reads)."""

import subprocess
import sys

import pytest

pytest.importorskip("transformers")

MODEL = (
    "import transformers\n"
    "cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,\n"
    "    num_attention_heads=4, num_key_value_heads=2, vocab_size=100)\n"
    "m = transformers.LlamaForCausalLM(cfg)\n"
    "m.set_attn_implementation('vpaged')\n"
    "assert m.config._attn_implementation == 'vpaged'\n"
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "entry",
    [
        "from vpaged.hf import VPagedCache",
        "import vpaged.hf",
        "import vpaged.serve",
        "import transformers\nfrom vpaged.hf import VPagedCache",  # transformers first, vpaged after
    ],
)
def test_one_import_makes_vpaged_attention_usable(entry):
    done = run(entry + "\n" + MODEL)
    assert done.returncode == 0, done.stderr[-2000:]


def test_without_the_import_transformers_refuses_the_name():
    done = run(MODEL)  # the reference: the name is unknown to transformers until vpaged registers it
    assert done.returncode != 0


def test_compat_alone_does_not_import_transformers():
    done = run("import sys, vpaged.hf.compat, vpaged.hf\nassert 'transformers' not in sys.modules")
    assert done.returncode == 0, done.stderr[-2000:]
