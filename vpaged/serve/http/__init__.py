"""vpaged.serve.http: the OpenAI-compatible HTTP server (server.py, app.py), one package per endpoint
(completion/, chat/: protocol.py the wire format, serving.py the handler) over what they share (common/)."""
