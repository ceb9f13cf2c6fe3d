"""POST /v1/chat/completions: its request and response models (protocol.py) and its handler (serving.py)."""
