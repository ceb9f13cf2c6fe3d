"""The README's usage example runs as written, and its error list is that of vpaged/errors.py."""

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


def test_readme_error_list_names_every_error_class():
    import vpaged.errors as errors

    text = README.read_text()
    paragraph = text.split("**Errors**", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(\w+(?:Error|Warning))`", paragraph))
    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, Warning | errors.VPagedError)
        and value is not errors.VPagedError
    }
    assert classes - named == set(), "errors.py classes missing from the README's error list"
    builtin = {"MemoryError"}  # named as a base class
    assert named - classes - builtin == set(), "the README's error list names classes errors.py does not define"
