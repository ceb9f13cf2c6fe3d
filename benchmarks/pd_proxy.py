"""A prefill/decode proxy for two vLLM instances on one vpaged page store (docs/vllm-connector.md, "Hand-off").

    .venv-vllm/bin/python benchmarks/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
        [--port 8000]

Each POST to /v1/completions or /v1/chat/completions goes first to the prefill instance (vLLM with the connector,
kv_role "kv_producer") with max_tokens 1, no streaming and kv_transfer_params {"do_remote_decode": true}: it
computes the prompt and publishes every block of it, the last one too, to the store. Then the request as the
client sent it goes to the decode instance (kv_role "kv_consumer") with the kv_transfer_params the prefill
answered with: it finds the whole prompt in the store, computes its last token, and generates; its answer
(streamed or not) is passed back as it comes. The two vLLM instances never talk to each other: the store is
how the pages travel. Other paths (/v1/models, /health, /metrics) go to the decode instance. The standard
library only, one thread per request.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


def _connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=3600)


def make_handler(prefill: str, decode: str):
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: a benchmark drives it
            return

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _relay(self, url: str, method: str, body: bytes | None) -> None:
            conn = _connect(url)
            try:
                conn.request(method, self.path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                self.send_response(resp.status)
                for name, value in resp.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := resp.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            finally:
                conn.close()

        def do_GET(self) -> None:
            self._relay(decode, "GET", None)

        def do_POST(self) -> None:
            body = self._body()
            if self.path not in GENERATE_PATHS:
                return self._relay(decode, "POST", body)
            request = json.loads(body)
            first = dict(request, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
            first.pop("stream_options", None)
            first.pop("max_completion_tokens", None)
            conn = _connect(prefill)
            try:
                conn.request("POST", self.path, json.dumps(first), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                answer = resp.read()
            finally:
                conn.close()
            if resp.status != 200:  # the prefill's error is the client's answer
                self.send_response(resp.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                return None
            params = json.loads(answer).get("kv_transfer_params") or {}
            return self._relay(decode, "POST", json.dumps(dict(request, kv_transfer_params=params)).encode())

    return Proxy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    ap.add_argument("--decode", required=True, help="the decode instance's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args.prefill, args.decode))
    print(
        f"proxy at http://{args.host}:{server.server_address[1]} (prefill {args.prefill}, decode {args.decode})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
