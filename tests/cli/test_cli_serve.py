"""`vpaged generate`, `vpaged serve` and `vpaged bench-serve` end to end (tiny random-weight models, fp32)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys

import pytest
import torch
from serve_helpers import (
    WORDS,
    assert_greedy_matches,
    save_model_with_tokenizer,
)

from vpaged.cli import main

TIMEOUT = 180


pytestmark = pytest.mark.serving  # skipped where transformers cannot serve (tests/conftest.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-cli")
    model, tok = save_model_with_tokenizer(path)
    return path, model, tok


def test_generate_token_ids_json_is_greedy_generate(capsys):
    from vpaged.serve import load_model

    rng = random.Random()
    prompts = [[rng.randrange(5, 300) for _ in range(rng.randint(2, 30))] for _ in range(2)]
    argv = ["generate", "random:llama-tiny", "--max-tokens", "7", "--temperature", "0", "--ignore-eos", "--json"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    ref, _ = load_model("random:llama-tiny", dtype=torch.float32)  # seeded: the same weights
    assert [r["prompt_token_ids"] for r in report["results"]] == prompts
    for p, r in zip(prompts, report["results"]):
        out = r["outputs"][0]
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 7
        assert_greedy_matches(out["token_ids"], p, ref, 7)
    assert report["stats"]["live_kv_tokens"] == 0


def test_generate_text_and_stream(model_dir, capsys):
    path, model, tok = model_dir
    prompt = " ".join(random.Random().choice(WORDS) for _ in range(6))
    common = [str(path), prompt, "--max-tokens", "9", "--temperature", "0", "--ignore-eos"]
    assert main(["generate", *common, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["results"][0]["outputs"][0]
    assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)
    assert_greedy_matches(out["token_ids"], tok.encode(prompt), model, 9)
    assert main(["generate", *common, "--stream"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(out["text"]) and "[length, 9 tokens]" in printed


def test_generate_bad_input_is_a_clear_error(capsys):
    assert main(["generate", "random:llama-tiny", "--prompt-ids", "1,2", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "random:llama-tiny", "some text"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert main(["generate", "random:no-such-model", "--prompt-ids", "1"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["bench-serve", "/no/such/dir", "--num-requests", "1"]) == 2
    assert "/no/such/dir" in capsys.readouterr().err


def test_bench_serve_json(tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench-serve",
                "random:llama-tiny",
                "--num-requests",
                "6",
                "--min-prompt",
                "4",
                "--max-prompt",
                "40",
                "--max-tokens",
                "5",
                "--kv-budget-mib",
                "16",
                "--json",
                "--no-progress",
                "--output",
                str(out_file),
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out_file.read_text()) == report
    r = report["result"]
    assert r["requests"] == 6 and r["output_tokens"] == 30 and r["finish_reasons"] == {"length": 6}
    assert 4 * 6 <= r["prompt_tokens"] <= 40 * 6
    assert r["output_tokens_per_s"] > 0 and r["peak_kv_bytes"] > 0 and 1 <= r["peak_running"] <= 6
    assert r["ttft_p50"] <= r["ttft_p99"]
    # Poisson arrivals and a shared prefix
    assert (
        main(
            [
                "bench-serve",
                "random:llama-tiny",
                "--num-requests",
                "4",
                "--min-prompt",
                "4",
                "--max-prompt",
                "8",
                "--shared-prefix",
                "64",
                "--max-tokens",
                "3",
                "--request-rate",
                "50",
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    r = json.loads(capsys.readouterr().out)["result"]
    assert r["output_tokens"] == 12 and r["prompt_tokens"] >= 4 * 68


def test_serve_subprocess_answers_openai_client(model_dir, server_process):
    openai = pytest.importorskip("openai")
    path, model, tok = model_dir
    args = [str(path), "--port", "0", "--served-model-name", "tiny", "--kv-budget-mib", "16"]
    server = server_process([*args, "--log-level", "warning", "--threads", "1"])
    try:
        server.ready(TIMEOUT)
        url = server.url
        assert url.startswith("http://127.0.0.1:")
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
            r = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "the cat"}],
                max_tokens=5,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
            text = "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model="tiny",
                    prompt="a dog",
                    max_tokens=5,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                if c.choices
            )
            assert (
                text
                == client.completions.create(
                    model="tiny", prompt="a dog", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
                )
                .choices[0]
                .text
            )
        # bench-serve against the running server, over HTTP
        bench = subprocess.run(
            [
                sys.executable,
                "-m",
                "vpaged.cli",
                "bench-serve",
                "--url",
                url,
                "--num-requests",
                "5",
                "--min-prompt",
                "3",
                "--max-prompt",
                "20",
                "--max-tokens",
                "4",
                "--vocab",
                "100",
                "--json",
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert bench.returncode == 0, bench.stderr
        r = json.loads(bench.stdout)["result"]
        assert r["requests"] == 5 and r["output_tokens"] == 20 and r["finish_reasons"] == {"length": 5}
        assert r["peak_kv_bytes"] > 0 and r["ttft_p50"] is not None and r["ttft_p50"] <= r["ttft_p99"]
    finally:
        rc, err = server.stop(signal.SIGINT)
    assert rc == 0, err


def test_serve_names_the_model_by_its_argument_and_passes_the_limits(monkeypatch):
    import vpaged.serve.http.server as server

    seen = {}

    def fake_serve(engine, **kw):
        seen.update(kw)

    monkeypatch.setattr(server, "serve", fake_serve)
    argv = ["serve", "random:llama-tiny", "--kv-budget-mib", "8", "--port", "0", "--max-n", "3", "--api-key", "k"]
    argv += ["--allowed-hosts", "a.example, b.example", "--max-body-kib", "16", "--header-timeout", "2"]
    assert main(argv) == 0
    assert seen["model_name"] == "random:llama-tiny"
    limits = seen["limits"]
    assert limits.max_n == 3 and limits.api_key == "k" and limits.allowed_hosts == ("a.example", "b.example")
    assert limits.max_body_bytes == 16 << 10 and limits.header_timeout_s == 2.0


def test_serve_refuses_bad_limits(capsys):
    assert main(["serve", "random:llama-tiny", "--max-n", "0"]) == 2
    assert "max_n" in capsys.readouterr().err
