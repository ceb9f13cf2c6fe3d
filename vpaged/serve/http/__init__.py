"""vpaged.serve.http: the OpenAI-compatible HTTP server (server.py) and its request schema (protocol.py)."""
