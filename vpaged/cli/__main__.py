"""`python -m vpaged.cli`: the `vpaged` command."""

import sys

from .main import main

sys.exit(main())
