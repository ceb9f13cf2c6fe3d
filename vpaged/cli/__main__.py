"""`python -m vpaged.cli`: the `vpaged` command."""

from .main import main

raise SystemExit(main())
