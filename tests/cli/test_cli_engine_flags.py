"""The engine's flags of `vpaged generate / serve / bench-serve` are EngineConfig's fields, both ways (issue #35:
the hand-written flags had lost --device, --layout, --page-size, --block-size and --watermark-fraction)."""

from __future__ import annotations

import argparse
import dataclasses
import random

import pytest
import torch
from serve_helpers import option_of

from vpaged.cli import main
from vpaged.cli.engine_flags import NOT_FLAGS, SPELLINGS, byte_count, dest_of, engine_config, flag_of
from vpaged.cli.serve import add_serve_commands
from vpaged.serve.config import FLAT_OPTIONS, PARTS, STORE_CONFIGS, EngineConfig

COMMANDS = ("generate", "serve", "bench-serve")


def parsers() -> dict[str, argparse.ArgumentParser]:
    top = argparse.ArgumentParser(prog="vpaged")
    sub = top.add_subparsers(dest="command")
    add_serve_commands(sub)
    return {name: sub.choices[name] for name in COMMANDS}


def engine_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    (group,) = [g for g in parser._action_groups if g.title.startswith("engine options")]
    return list(group._group_actions)


def every_field() -> set[str]:
    """Every option an EngineConfig takes, read from the parts themselves (not from the flat list)."""
    names = {f.name for cls in (*STORE_CONFIGS.values(), *PARTS.values()) for f in dataclasses.fields(cls)}
    names |= {f.name for f in dataclasses.fields(EngineConfig) if f.init and f.name not in ("store", *PARTS)}
    return names | {"kv"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_option_has_a_flag_and_every_flag_an_option(command):
    actions = engine_actions(parsers()[command])
    dests = [a.dest for a in actions]
    fields_of = {dest_of(name): name for name in every_field()}
    dests = [fields_of.get(d, d) for d in dests]
    assert len(dests) == len(set(dests))
    assert set(dests) <= every_field(), "a flag that maps to no EngineConfig field"
    missing = every_field() - set(dests) - set(NOT_FLAGS)
    assert missing == set(), f"EngineConfig fields without a flag: {sorted(missing)}"
    assert all(reason for reason in NOT_FLAGS.values()) and set(NOT_FLAGS) <= every_field()
    assert set(FLAT_OPTIONS) == every_field()
    for a in actions:
        assert a.help, f"{a.option_strings}: give the field metadata=option('help')"
        assert a.option_strings == [flag_of(fields_of[a.dest])] or a.dest == "kv"


def test_serve_help_lists_the_flags_the_issue_names(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--device", "--layout", "--page-size", "--block-size", "--watermark-fraction", "--engine-seed"):
        assert flag in text, flag
    # The names of earlier releases still work (tests/cli/test_cli_serve.py and the README use them).
    for flag in ("--kv-budget-mib", "--swap-mib", "--no-prefix-caching", "--no-cpu-prepack", "--kv-dtype"):
        assert flag in text, flag


def random_argv(rng: random.Random, kind: str) -> tuple[list[str], dict]:
    """Flags with random valid values for a store of `kind`, and the EngineConfig fields they must give."""
    budget, seqs, tokens = rng.randint(1, 4096), rng.randint(1, 512), rng.randint(1, 8192)
    watermark, seed, tp = rng.choice([0.0, 0.01, 0.25, 0.5]), rng.randrange(1 << 31), rng.randint(1, 8)
    dtype = rng.choice(["float32", "float16", "bfloat16"])
    argv = ["random:llama-tiny", "--kv", kind, "--kv-budget-mib", str(budget), "--max-num-seqs", str(seqs)]
    argv += ["--max-num-batched-tokens", str(tokens), "--watermark-fraction", str(watermark)]
    argv += ["--engine-seed", str(seed), "--tensor-parallel-size", str(tp), "--dtype", dtype]
    argv += ["--device", "cpu", "--kv-dtype", "int8", "--no-cpu-prepack"]
    want = dict(kv_budget_bytes=budget * 2**20, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    want.update(watermark_fraction=watermark, seed=seed, tensor_parallel_size=tp, dtype=getattr(torch, dtype))
    want.update(device=torch.device("cpu"), kv_dtype="int8", cpu_prepack=False)
    if rng.random() < 0.5:
        max_len = rng.randint(16, 1 << 16)
        argv += ["--max-model-len", str(max_len)]
        want["max_model_len"] = max_len
    if kind in ("vpaged", "static"):
        kib = rng.choice([64, 128, 2048])
        layout = rng.choice(["per_layer", "interleaved", "head_major"])
        argv += ["--page-size", f"{kib}KiB" if rng.random() < 0.5 else str(kib << 10), "--layout", layout]
        want.update(page_size=kib << 10, layout=layout)
    if kind == "vpaged":
        swap = rng.randint(0, 64)
        argv += ["--swap-mib", str(swap), "--no-prefix-caching"]
        want.update(swap_bytes=swap * 2**20, enable_prefix_caching=False)
    if kind == "paged":
        block = rng.choice([8, 16, 32])
        argv += ["--block-size", str(block)]
        want["block_size"] = block
    return argv, want


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", list(STORE_CONFIGS))
def test_the_flags_give_the_config_they_say(command, kind):
    rng = random.Random()
    argv, want = random_argv(rng, kind)
    own_seed = rng.randrange(1 << 31)  # the command's own --seed (requests', prompts') is not the engine's
    if command != "serve":
        argv += ["--seed", str(own_seed)]
    args = parsers()[command].parse_args(argv)
    config = engine_config(args)
    if command != "serve":
        assert args.seed == own_seed
    assert config.kv == kind and type(config.store) is STORE_CONFIGS[kind]
    assert {name: option_of(config, name) for name in want} == want
    assert config.unused_options == ()


def test_flags_not_given_leave_the_configs_defaults():
    config = engine_config(parsers()["serve"].parse_args(["random:llama-tiny"]))
    defaults = EngineConfig(kv_budget_bytes=1024 << 20, dtype=torch.float32)  # the CLI's two defaults of its own
    assert config == defaults and config.kv == "vpaged"
    assert SPELLINGS["kv_budget_bytes"].default == "1024" and SPELLINGS["dtype"].default == "float32"


@pytest.mark.parametrize(
    "kind, flags, named",
    [
        ("paged", ["--layout", "interleaved"], "--layout"),
        ("paged", ["--page-size", "64KiB", "--swap-mib", "4"], "--page-size, --swap-mib"),
        ("vpaged", ["--block-size", "32"], "--block-size"),
        ("static", ["--no-prefix-caching"], "--no-prefix-caching"),
    ],
)
def test_a_store_flag_of_another_kind_is_refused(kind, flags, named, capsys):
    args = parsers()["serve"].parse_args(["random:llama-tiny", "--kv", kind, *flags])
    with pytest.raises(ValueError, match=f"{named}: not an option of --kv {kind}"):
        engine_config(args)
    # through the command: one line, exit status 2, before any model is loaded
    assert main(["generate", "random:no-such-model", "--prompt-ids", "1", "--kv", kind, *flags]) == 2
    err = capsys.readouterr().err
    assert f"not an option of --kv {kind}" in err and "no-such-model" not in err


@pytest.mark.parametrize("flags", [["--block-size", "12"], ["--layout", "diagonal"], ["--dtype", "int8"]])
def test_a_value_outside_a_fields_choices_is_an_argparse_error(flags, capsys):
    with pytest.raises(SystemExit) as e:
        parsers()["serve"].parse_args(["random:llama-tiny", *flags])
    assert e.value.code == 2 and "invalid" in capsys.readouterr().err


def test_a_bad_value_is_the_configs_error_in_one_line(capsys):
    assert main(["generate", "random:llama-tiny", "--prompt-ids", "1", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be a positive int, got 0" in capsys.readouterr().err
    assert main(["generate", "random:llama-tiny", "--prompt-ids", "1", "--device", "meta"]) == 2
    assert "not 'meta'" in capsys.readouterr().err


def test_byte_counts():
    rng = random.Random()
    n = rng.randint(1, 1 << 20)
    assert byte_count(str(n)) == n
    assert byte_count(f"{n}KiB") == byte_count(f"{n}k") == n << 10
    assert byte_count(f"{n}MiB") == n << 20 and byte_count("1GiB") == 1 << 30
    for bad in ("", "2MB", "x", "1.5MiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_count(bad)
