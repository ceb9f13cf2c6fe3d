"""`vpaged serve` with several models (cli/served_models.py): --model NAME=PATH and --models-config FILE build
one engine per model, all members of one shared budget named after their models (one the server makes and
removes, or --shared-budget's), per-model options from the file; bad files and flags are refused with exit
status 2 and a message naming the model and the field; a real server of two models answers both."""

from __future__ import annotations

import json
import os
import random
import signal
import uuid

import pytest

from vpaged.cli import main
from vpaged.memory import SharedBudget
from vpaged.memory.budget.segment import segment_path

pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)

TIMEOUT = 180


@pytest.fixture
def captured(monkeypatch):
    """Runs `vpaged serve` with the server replaced: what it would serve, and the budget while it serves."""
    import vpaged.serve.http.server as server

    seen = {}

    def fake_serve(engine, **kw):
        seen.update(kw, engine=engine)
        budgets = {e.config.store.shared_budget for e in engine.values()} if isinstance(engine, dict) else set()
        seen["budgets"] = budgets
        seen["states"] = [SharedBudget.open(b).state() for b in budgets if b is not None]

    monkeypatch.setattr(server, "serve", fake_serve)
    return seen


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_several_models_share_one_budget_made_and_removed_here(captured, tmp_path):
    length = random.choice([128, 200, 333])
    config = write(tmp_path, "models.toml", f'[models.b]\npath = "random:llama-tiny:2"\nmax_model_len = {length}\n')
    argv = ["serve", "--model", "a=random:llama-tiny:1", "--models-config", config, "--kv-budget-mib", "8"]
    assert main([*argv, "--port", "0", "--no-cpu-prepack"]) == 0
    engines = captured["engine"]
    assert list(engines) == ["a", "b"] and captured["model_name"] is None
    assert engines["b"].max_model_len == length and engines["a"].max_model_len != length
    (budget,) = captured["budgets"]
    (state,) = captured["states"]
    assert state.capacity_bytes == 8 << 20
    assert sorted(m.name for m in state.members) == ["a", "b"]
    assert {m.name: m.model for m in state.members} == {"a": "random:llama-tiny:1", "b": "random:llama-tiny:2"}
    assert all(m.ceiling_bytes == 8 << 20 for m in state.members)
    assert not os.path.exists(segment_path(budget))  # removed when the server ended


def test_several_models_join_the_shared_budget_given(captured, tmp_path):
    name = f"cli-mm-{uuid.uuid4().hex[:10]}"
    SharedBudget.create(name, capacity_bytes=16 << 20)
    try:
        config = write(tmp_path, "m.json", json.dumps({"models": {"c": {"path": "random:llama-tiny", "kv": "paged"}}}))
        argv = ["serve", "random:llama-tiny:3", "--served-model-name", "main", "--models-config", config]
        assert main([*argv, "--shared-budget", name, "--kv-budget-mib", "4", "--no-cpu-prepack"]) == 0
        assert captured["budgets"] == {name}
        (state,) = captured["states"]
        members = {m.name: m for m in state.members}
        assert set(members) == {"main", "c"}
        assert members["main"].model == "random:llama-tiny:3" and members["c"].model == "random:llama-tiny"
        assert members["main"].ceiling_bytes == 4 << 20
        assert members["c"].min_bytes > 0  # the paged baseline reserves its block pools whole
        assert os.path.exists(segment_path(name))  # not this server's to remove
    finally:
        SharedBudget.remove(name, force=True)


def test_one_model_by_flag_keeps_its_name_and_member(monkeypatch):
    import vpaged.serve.http.server as server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda engine, **kw: seen.update(kw, engine=engine))
    assert main(["serve", "--model", "random:llama-tiny", "--kv-budget-mib", "8", "--port", "0"]) == 0
    assert seen["model_name"] == "random:llama-tiny" and not isinstance(seen["engine"], dict)
    name = f"cli-one-{uuid.uuid4().hex[:10]}"
    SharedBudget.create(name, capacity_bytes=16 << 20)
    try:
        members = []
        monkeypatch.setattr(
            server, "serve", lambda engine, **kw: members.extend(SharedBudget.open(name).state().members)
        )
        argv = ["serve", "--model", "tiny=random:llama-tiny", "--shared-budget", name, "--kv-budget-mib", "8"]
        assert main(argv) == 0
        assert [(m.name, m.model) for m in members] == [("tiny", "random:llama-tiny")]
    finally:
        SharedBudget.remove(name, force=True)


def test_one_model_of_a_file_is_served_alone_with_its_options(monkeypatch, tmp_path):
    import vpaged.serve.http.server as server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda engine, **kw: seen.update(kw, engine=engine))
    length = random.randint(64, 400)
    config = write(tmp_path, "one.toml", f'[models.solo]\npath = "random:llama-tiny"\nmax_model_len = {length}\n')
    assert main(["serve", "--models-config", config, "--kv-budget-mib", "8", "--no-cpu-prepack"]) == 0
    assert seen["model_name"] == "solo" and seen["engine"].max_model_len == length


BAD_FILES = [
    ("m.toml", '[models.a]\npath = "random:llama-tiny"\nmax_modle_len = 5\n', ["'a'", "max_modle_len"]),
    ("m.toml", '[models.a]\npath = "random:llama-tiny"\nmax_model_len = "long"\n', ["'a'", "max_model_len"]),
    ("m.toml", '[models.a]\npath = "random:llama-tiny"\nmax_num_seqs = -3\n', ["'a'", "max_num_seqs"]),
    ("m.toml", "[models.a]\nmax_model_len = 5\n", ["'a'", "path"]),
    ("m.toml", '[models.a]\npath = "random:llama-tiny"\nshared_budget = "x"\n', ["'a'", "shared_budget"]),
    ("m.toml", '[models.a]\npath = "random:llama-tiny"\nkv_budget_bytes = "lots"\n', ["'a'", "kv_budget_bytes"]),
    ("m.toml", '[models.a]\npath = "random:llama-tiny"\nkv = "paged"\nlayout = "interleaved"\n', ["'a'", "layout"]),
    ("m.toml", '[models.a]\npath = "random:llama-tiny"\ntensor_parallel_size = 2\n', ["tensor_parallel_size"]),
    ("m.toml", '[models.a]\npath = "random:llama-tiny"\ndtype = "float7"\n', ["'a'", "dtype"]),
    ("m.toml", "[models.a\n", ["not valid TOML"]),
    ("m.toml", '[other]\npath = "x"\n', ["models", "other"]),
    ("m.toml", "models = 3\n", ["models"]),
    ("m.json", '{"models": {"a": "random:llama-tiny"}}', ["'a'", "table"]),
    ("m.json", "{", ["not valid JSON"]),
    ("m.toml", '[models.a]\npath = "random:nope"\n[models.b]\npath = "random:llama-tiny"\n', ["'a'", "nope"]),
]


@pytest.mark.parametrize("filename, text, words", BAD_FILES)
def test_a_bad_models_file_is_refused_naming_the_model_and_field(tmp_path, capsys, filename, text, words):
    config = write(tmp_path, filename, text)
    argv = ["serve", "--model", "z=random:llama-tiny", "--models-config", config, "--kv-budget-mib", "4"]
    before = set(os.listdir("/dev/shm"))
    assert main([*argv, "--no-cpu-prepack"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("vpaged-budget.serve-")}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "a=random:llama-tiny", "--model", "a=random:llama-tiny:2"], ["two models", "'a'"]),
        (["--served-model-name", "x", "--model", "a=random:llama-tiny"], ["--served-model-name"]),
        ([], ["give a model"]),
        (["--models-config", "/nonexistent/models.toml"], ["cannot read"]),
    ],
)
def test_bad_model_flags_are_refused(capsys, argv, words):
    assert main(["serve", *argv, "--kv-budget-mib", "4"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_a_model_flag_without_a_name_or_path_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "=random:llama-tiny"])
    assert e.value.code == 2 and "NAME=PATH" in capsys.readouterr().err


def test_serve_subprocess_of_two_models_answers_both(server_process):
    httpx = pytest.importorskip("httpx")
    args = ["--model", "a=random:llama-tiny:1", "--model", "b=random:llama-tiny:2", "--port", "0"]
    server = server_process([*args, "--kv-budget-mib", "8", "--log-level", "warning", "--threads", "1"])
    try:
        line = server.ready(TIMEOUT)
        url = server.base_url
        budget = line.split("one budget ")[1].split()[0]
        assert os.path.exists(segment_path(budget))
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["a", "b"]
            prompt = [random.randrange(11, 500) for _ in range(8)]
            got = {}
            for name in ("a", "b"):
                body = {"model": name, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["model"] == name, r.text
                got[name] = r.json()["choices"][0]["token_ids"]
            assert got["a"] != got["b"] and all(len(t) == 4 for t in got.values())
            assert client.post("/v1/completions", json={**body, "model": "c"}).status_code == 404
    finally:
        rc, err = server.stop(signal.SIGINT)
    assert rc == 0, err
    assert not os.path.exists(segment_path(budget))  # the server removed the budget it made
