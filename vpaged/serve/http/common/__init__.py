"""What both generation endpoints share: the sampling fields of a request (protocol.py), the reading of a
body into a request model (parse.py), the usage and error records, JSON responses of typed bodies
(responses.py) and the per-model state and steps of a generation (serving.py)."""
