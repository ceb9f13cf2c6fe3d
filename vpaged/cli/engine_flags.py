"""The engine's flags of `vpaged generate`, `serve` and `bench-serve`, made from EngineConfig's parts.

Every field of SchedulerConfig, of each kind's StoreConfig, of ModelConfig, ParallelConfig and EngineConfig's
own is a flag named after it (max_num_seqs: --max-num-seqs), with the help and the choices of the field's
metadata (vpaged/serve/config.py). SPELLINGS keeps the names of earlier releases where they differ
(--kv-budget-mib in MiB, --no-prefix-caching); NOT_FLAGS lists the fields left out, and why.
tests/cli/test_cli_engine_flags.py checks that every field has a flag and every flag a field.

A flag not given leaves the config's default. A store flag of another kind than --kv (say --block-size with
--kv vpaged) is refused: it would change nothing.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from ..serve.config import FLAT_OPTIONS, PARTS, STORE_CONFIGS, EngineConfig
from .record_flags import Spelling, add_field_flag, flag_name, value_type

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def byte_count(text: str) -> int:
    """A size in bytes: '65536', '64KiB', '2MiB', '1GiB' (K/M/G: binary units)."""
    t = text.strip().lower()
    digits = t.rstrip("kmgib")
    try:
        return int(digits) * _UNITS[t[len(digits) :]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 65536, 64KiB, 2MiB)") from None


def kv_scales(text: str):
    """--kv-scales: 'calibrate' or a number."""
    if text == "calibrate":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or 'calibrate', got {text!r}") from None


SPELLINGS = {
    "kv_budget_bytes": Spelling("--kv-budget-mib", scale=1 << 20, default="1024", metavar="MIB"),
    "swap_bytes": Spelling("--swap-mib", scale=1 << 20, metavar="MIB"),
    "enable_prefix_caching": Spelling("--no-prefix-caching", negated=True),
    "cpu_prepack": Spelling("--no-cpu-prepack", negated=True),
    "direct_forward": Spelling("--no-direct-forward", negated=True),
    "prefix_store_map": Spelling("--prefix-store-copy", negated=True),
    "dtype": Spelling("--dtype", default="float32"),  # a directory's weights load as float32 unless told
    "seed": Spelling("--engine-seed"),  # --seed is the requests' (generate) or the prompts' (bench-serve)
}

# Parsers of the fields whose values are not a plain int, float or str.
PARSERS = {"dtype": DTYPES.__getitem__, "kv_scales": kv_scales, "page_size": byte_count}
CHOICES = {"dtype": tuple(DTYPES)}

NOT_FLAGS = {
    "record_steps": "a per-step timing record read in process (LLMEngine.step_log); no command prints it",
}


def _fields() -> dict[str, dataclasses.Field]:
    """Every engine option's field by name: the store kinds' (first seen), the parts', EngineConfig's own."""
    found: dict[str, dataclasses.Field] = {}
    classes = [*STORE_CONFIGS.values(), *PARTS.values(), EngineConfig]
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.init and f.name in FLAT_OPTIONS and f.name not in found:
                found[f.name] = f
    return found


def _kinds_of(name: str) -> list[str]:
    return [kind for kind, cls in STORE_CONFIGS.items() if name in cls.__dataclass_fields__]


def dest_of(name: str) -> str:
    """Where argparse keeps a field's flag: the field's name, but not where a command keeps its own flag of
    that name (--seed of generate and bench-serve)."""
    return "engine_seed" if name == "seed" else name


def flag_of(name: str) -> str:
    spelling = SPELLINGS.get(name)
    return spelling.flag if spelling is not None else flag_name(name)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's options as flags (dest: dest_of(the field's name)), in a group of their own."""
    group = p.add_argument_group("engine options (vpaged.serve.EngineConfig)")
    group.add_argument(
        "--kv", dest="kv", choices=list(STORE_CONFIGS), default=None, help="KV store kind (default vpaged)"
    )
    for name, f in _fields().items():
        if name in NOT_FLAGS:
            continue
        spelling = SPELLINGS.get(name, Spelling(flag_of(name)))
        kinds = _kinds_of(name)
        suffix = f" [--kv {' / '.join(kinds)}]" if kinds and len(kinds) < len(STORE_CONFIGS) else ""
        if spelling.default is not None:
            shown = spelling.default
        elif f.default is not dataclasses.MISSING and f.default is not None:
            shown = str(f.default)
        else:
            shown = None
        add_field_flag(
            group,
            f,
            spelling,
            dest=dest_of(name),
            default=spelling.default,  # None: the config's default (a flag not given is left out)
            parse=PARSERS.get(name) or value_type(f.type),
            choices=CHOICES.get(name) or f.metadata.get("choices"),
            shown_default=shown,
            help_suffix=suffix,
        )


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the flags gave (the CLI's own defaults included), as EngineConfig's flat fields."""
    options = {}
    for name in FLAT_OPTIONS:
        value = getattr(args, dest_of(name), None)
        if value is None:
            continue
        if name == "kv_dtype" and value == "auto":
            continue  # the config's default: the model's dtype
        options[name] = value
    return options


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags; InvalidArgumentError (via EngineConfig) for bad values, ValueError for
    a store flag the chosen --kv does not take."""
    config = EngineConfig(**engine_options(args))
    if config.unused_options:
        flags = ", ".join(flag_of(name) for name in config.unused_options)
        takes = ", ".join(flag_of(n) for n in _fields() if _kinds_of(n) and config.kv in _kinds_of(n))
        raise ValueError(f"{flags}: not an option of --kv {config.kv} (its store options: {takes})")
    return config
