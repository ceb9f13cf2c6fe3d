"""benchmarks/pd_proxy.py speaks vLLM's kv_transfer_params protocol: the prefill instance gets the request with
max_tokens 1, no stream and {"do_remote_decode": true}; the decode instance gets the request as the client sent
it plus the params the prefill answered with; a streamed answer comes back as the decode instance sends it; a
prefill error is the client's answer. Against two stand-in instances (no vLLM needed)."""

from __future__ import annotations

import http.client
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import pd_proxy  # noqa: E402

sys.path.remove(str(BENCH))


class Instance:
    """A stand-in vLLM instance: records every request body; answers with `answer(body)` -> (status, bytes)."""

    def __init__(self, answer):
        self.seen: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                return

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.seen.append(body)
                status, data = answer(body)
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()


@pytest.fixture
def setup():
    params = {"do_remote_prefill": True, "do_remote_decode": False, "vpaged_store": "kv"}
    prefill = Instance(lambda b: (200, json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": params}).encode()))
    stream = b"".join(b'data: {"choices": [{"text": "t%d"}]}\n\n' % i for i in range(3)) + b"data: [DONE]\n\n"
    decode = Instance(lambda b: (200, stream if b.get("stream") else b'{"choices": [{"text": "all"}]}'))
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), pd_proxy.make_handler(prefill.url, decode.url))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield prefill, decode, proxy.server_address[1], params, stream
    proxy.shutdown()
    prefill.close()
    decode.close()


def _post(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_the_prefill_then_the_decode_with_its_params(setup, stream):
    prefill, decode, port, params, streamed = setup
    request = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 40, "stream": stream, "temperature": 0}
    if stream:
        request["stream_options"] = {"include_usage": True}
    status, body = _post(port, request)
    assert status == 200
    assert body == (streamed if stream else b'{"choices": [{"text": "all"}]}')
    (first,) = prefill.seen
    assert first["max_tokens"] == 1 and first["stream"] is False and "stream_options" not in first
    assert first["kv_transfer_params"] == {"do_remote_decode": True} and first["prompt"] == [5, 6, 7]
    (second,) = decode.seen
    assert second == dict(request, kv_transfer_params=params)


def test_a_prefill_error_is_the_answer_and_the_decode_is_never_asked(setup):
    _, decode, _, _, _ = setup
    failing = Instance(lambda b: (400, b'{"error": "prompt too long"}'))
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), pd_proxy.make_handler(failing.url, decode.url))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        status, body = _post(proxy.server_address[1], {"model": "m", "prompt": [1], "max_tokens": 4})
    finally:
        proxy.shutdown()
        failing.close()
    assert status == 400 and b"prompt too long" in body and decode.seen == []
