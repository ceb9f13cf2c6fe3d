"""The README's usage example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_usage_example_runs():
    text = README.read_text()
    usage = text.split("## Usage", 1)[1]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    cache = namespace["cache"]
    assert namespace["s"].live_tokens == 100
    assert namespace["out"].shape == (1, 8, 1, 64)
    assert cache._closed
