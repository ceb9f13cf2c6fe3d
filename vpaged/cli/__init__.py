"""vpaged.cli: the `vpaged` command (main.py) and its subcommands: demo, serve / generate / bench-serve
(serve.py), bench (bench.py over the suite in suite.py) and simulate (simulate.py)."""

from .main import main

__all__ = ["main"]
