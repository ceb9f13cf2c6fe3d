"""Every flag of `vpaged generate / serve / bench-serve` is a field of the record it fills, its default and help
the field's (issue #50: the limits' flags restated their defaults, `--max-body-kib 4096` beside `4 << 20`)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import random
import re
from pathlib import Path

import pytest

from vpaged.cli import main
from vpaged.cli.command_options import (
    BenchServeOptions,
    GenerateOptions,
    GenerateSampling,
    ProcessOptions,
    ServedModelsOptions,
)
from vpaged.cli.record_flags import add_record_flags, record_of
from vpaged.cli.serve import add_serve_commands
from vpaged.serve import SamplingParams
from vpaged.serve.bench import WorkloadSpec, random_prompts
from vpaged.serve.http.guard import ServerLimits
from vpaged.serve.http.options import TOOL_CALL_PARSERS, ServerOptions
from vpaged.serve.options import option

ROOT = Path(__file__).resolve().parents[2]
RECORDS = {
    "generate": (ProcessOptions, GenerateOptions, GenerateSampling),
    "serve": (ProcessOptions, ServedModelsOptions, ServerOptions, ServerLimits),
    "bench-serve": (ProcessOptions, BenchServeOptions, WorkloadSpec),
}
MINIMAL = {"generate": ["random:llama-tiny"], "serve": [], "bench-serve": []}


def parsers() -> dict[str, argparse.ArgumentParser]:
    top = argparse.ArgumentParser(prog="vpaged")
    sub = top.add_subparsers(dest="command")
    add_serve_commands(sub)
    return {name: sub.choices[name] for name in RECORDS}


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def engine_dests(parser: argparse.ArgumentParser) -> set[str]:
    (group,) = [g for g in parser._action_groups if g.title.startswith("engine options")]
    return {a.dest for a in group._group_actions}


def record_fields(command: str) -> list[tuple[type, dataclasses.Field]]:
    return [(cls, f) for cls in RECORDS[command] for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("command", RECORDS)
def test_every_flag_is_a_record_field_or_an_engine_option(command):
    parser = parsers()[command]
    own = {f.name for _, f in record_fields(command)}
    positional = {"model"} | ({"prompt"} if command == "generate" else set())
    dests = set(actions_by_dest(parser)) - {"help"}
    assert dests - engine_dests(parser) - positional == own, "a flag that is not a record's field, or the reverse"
    assert not own & engine_dests(parser), "a record field that is also an engine option"


def test_only_the_positional_arguments_are_written_by_hand():
    assert (ROOT / "vpaged" / "cli" / "serve.py").read_text().count("add_argument") == 2  # MODEL, prompts


@pytest.mark.parametrize("command", RECORDS)
def test_each_flags_default_and_help_come_from_its_field(command):
    parser = parsers()[command]
    actions = actions_by_dest(parser)
    parsed = parser.parse_args(MINIMAL[command])
    for cls, f in record_fields(command):
        action, default, m = actions[f.name], f.default, f.metadata
        assert m["help"] in action.help, (cls.__name__, f.name)
        want = list(default) if m["repeat"] and default is not None else default
        assert getattr(parsed, f.name) == want, (cls.__name__, f.name)
        scale = m["scale"] or 1
        if m["default_text"] is not None:
            assert action.help.endswith(f"; default {m['default_text']}")
        elif default is not None and default != () and not isinstance(default, bool):
            assert scale == 1 or default % scale == 0
            shown = str(default // scale if scale != 1 else default)
            assert action.help.endswith(f"; default {shown}")
            # the default --help names, given as the flag's value, is the field's default again
            given = parser.parse_args([*MINIMAL[command], action.option_strings[0], shown])
            assert getattr(given, f.name) == default
        if m["choices"] is not None:
            assert default in m["choices"]
    for cls in RECORDS[command]:
        assert record_of(cls, parsed) == cls(), cls.__name__


def test_flags_keep_their_names():
    """The spellings scripts use (tests/cli/test_cli_serve.py, docs/serving.md) stay."""
    flags = {c: {s for a in p._actions for s in a.option_strings} for c, p in parsers().items()}
    assert {
        "--max-body-kib",
        "--max-response-mib",
        "--header-timeout",
        "--body-timeout",
        "--keep-alive-timeout",
    } <= flags["serve"]
    assert {"--host", "--port", "--served-model-name", "--model", "--chat-template", "--api-key"} <= flags["serve"]
    assert {"--prompt-ids", "--stop-token-id", "--ignore-eos", "--stream", "--json", "--threads"} <= flags["generate"]
    assert {"--url", "--no-progress", "--request-rate", "--vocab", "--seed", "--output"} <= flags["bench-serve"]


def test_limit_flags_land_in_server_limits_in_the_fields_units():
    rng = random.Random()
    kib, mib, n = rng.randint(1, 1 << 16), rng.randint(1, 4096), rng.randint(1, 100)
    header, body, idle = (round(rng.uniform(0.1, 100), 3) for _ in range(3))
    argv = ["--max-body-kib", str(kib), "--max-response-mib", str(mib), "--max-n", str(n)]
    argv += ["--header-timeout", str(header), "--body-timeout", str(body), "--keep-alive-timeout", str(idle)]
    argv += ["--allowed-hosts", "A.example, ,b.example", "--max-prompt-tokens", "77", "--api-key", "k"]
    limits = record_of(ServerLimits, parsers()["serve"].parse_args(argv))
    want = ServerLimits(
        max_body_bytes=kib * 1024,
        max_response_bytes=mib * 1024 * 1024,
        max_n=n,
        header_timeout_s=header,
        body_timeout_s=body,
        keep_alive_s=idle,
        allowed_hosts=("a.example", "b.example"),
        max_prompt_tokens=77,
        api_key="k",
    )
    assert limits == want
    assert record_of(ServerLimits, parsers()["serve"].parse_args(["--max-body-kib", "8"])).max_body_bytes == 8192


def test_sampling_flags_give_the_sampling_params_they_say():
    rng = random.Random()
    want = dict(max_tokens=rng.randint(1, 500), temperature=round(rng.uniform(0, 2), 3), top_k=rng.randint(1, 50))
    want.update(top_p=round(rng.uniform(0.05, 1), 3), seed=rng.randrange(1 << 40), n=rng.randint(1, 4))
    stops = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
    argv = ["random:llama-tiny", "--ignore-eos", *(x for s in stops for x in ("--stop-token-id", str(s)))]
    argv += [x for k, v in want.items() for x in ("--" + k.replace("_", "-"), str(v))]
    params = record_of(GenerateSampling, parsers()["generate"].parse_args(argv)).params()
    assert params == SamplingParams(**want, stop_token_ids=tuple(stops), ignore_eos=True)


def test_sampling_defaults_are_sampling_params_but_max_tokens():
    ours = {f.name: f.default for f in dataclasses.fields(GenerateSampling)}
    theirs = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert ours.pop("max_tokens") == 32  # generate's own since its first release (SamplingParams': 16)
    assert ours == {name: theirs[name] for name in ours}
    assert GenerateSampling().params() == SamplingParams(max_tokens=32)


def test_server_options_are_serves_keywords_with_its_defaults():
    server = pytest.importorskip("vpaged.serve.http.server")
    signature = inspect.signature(server.serve).parameters
    for f in dataclasses.fields(ServerOptions):
        assert signature[f.name].default == f.default, f.name
    tools = pytest.importorskip("vpaged.serve.http.tools")
    assert set(TOOL_CALL_PARSERS) == set(tools.PARSERS)


def test_workload_flags_give_the_workload_they_say():
    rng = random.Random()
    seed, num, lo, prefix = rng.randrange(1 << 30), rng.randint(1, 20), rng.randint(1, 30), rng.randint(0, 8)
    hi, vocab = lo + rng.randint(0, 30), rng.randint(100, 5000)
    argv = ["--num-requests", str(num), "--min-prompt", str(lo), "--max-prompt", str(hi), "--seed", str(seed)]
    argv += ["--shared-prefix", str(prefix), "--vocab", str(vocab), "--request-rate", "3.5", "--max-tokens", "9"]
    spec = record_of(WorkloadSpec, parsers()["bench-serve"].parse_args(argv))
    workload = spec.draw(32000)
    assert workload.prompts == random_prompts(num, lo, hi, vocab, seed=seed, shared_prefix=prefix)
    assert workload.max_tokens == 9 and len(workload.arrivals) == num and workload.arrivals[0] == 0.0
    assert all(a <= b for a, b in zip(workload.arrivals, workload.arrivals[1:]))
    assert WorkloadSpec().request_rate == math.inf and WorkloadSpec(num_requests=3).draw(50).arrivals == [0.0] * 3
    assert max(t for p in WorkloadSpec(vocab=None, num_requests=4).draw(50).prompts for t in p) < 50


def test_bad_server_options_are_refused_before_any_model_is_loaded(capsys):
    assert main(["serve", "random:no-such-model", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "port must be an int in 0..65535" in err and "no-such-model" not in err


def test_a_record_field_without_option_metadata_or_with_an_on_switch_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Bare:
        size: int = 1

    @dataclasses.dataclass(frozen=True)
    class OnSwitch:
        color: bool = dataclasses.field(default=True, metadata=option("colors"))

    for cls, what in ((Bare, "without metadata"), (OnSwitch, "a switch defaults to False")):
        with pytest.raises(TypeError, match=what):
            add_record_flags(argparse.ArgumentParser(), cls)


COMMAND_LINE = re.compile(r"vpaged (generate|serve|bench-serve)\b([^\n`]*)")


@pytest.mark.parametrize("page", ["docs/serving.md", "docs/cli.md"])
def test_the_flags_the_docs_write_on_a_command_line_exist(page):
    text = (ROOT / page).read_text()
    flags = {c: {s for a in p._actions for s in a.option_strings} for c, p in parsers().items()}
    for command, rest in COMMAND_LINE.findall(text):
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
            assert flag in flags[command], f"{page}: vpaged {command} {flag}"


def test_the_defaults_the_serving_docs_quote_are_the_flags():
    """docs/serving.md writes a limit's default beside its flag (`--max-body-kib` (4096; ...)): the record's."""
    actions = {s: a for a in parsers()["serve"]._actions for s in a.option_strings}
    quoted = re.findall(r"`(--[a-z-]+)` \((\d+(?:\.\d+)?)[ ;)]", (ROOT / "docs" / "serving.md").read_text())
    assert len(quoted) >= 6
    for flag, number in quoted:
        shown = re.search(r"; default ([\d.]+)$", actions[flag].help).group(1)
        assert float(shown) == float(number), (flag, number, shown)
