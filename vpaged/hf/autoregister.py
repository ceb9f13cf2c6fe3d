"""attn_implementation="vpaged" known to transformers once vpaged.hf is imported, without importing transformers.

`import vpaged.hf` (which `from vpaged.hf import VPagedCache` and `import vpaged.serve` do too) calls
register_when_transformers_loads(). The attention function can only be registered into transformers'
AttentionInterface, which lives in `transformers.modeling_utils`; vpaged.hf must not import that itself,
because `vpaged info` reads `vpaged.hf.compat` without transformers. So:

- if `transformers.modeling_utils` is loaded already, the function is registered now;
- otherwise a finder on sys.meta_path waits for it and registers right after that module has run, i.e.
  before any model exists, so `from_pretrained(..., attn_implementation="vpaged")` and
  `model.set_attn_implementation("vpaged")` find the name whichever of the two packages a script imports
  first. The finder removes itself when it fires; until then it costs one string comparison per import.

A failure to register (e.g. an unsupported transformers release) becomes a warning, never an error in the
user's import of transformers; `vpaged info` says which releases are supported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings

WATCHED = "transformers.modeling_utils"  # defines AttentionInterface; every model class imports it

_lock = threading.Lock()


def register_now() -> None:
    """Register attn_implementation="vpaged" (idempotent; imports transformers)."""
    importlib.import_module(".attention", __package__).register()


def _register_or_warn() -> None:
    try:
        register_now()
    except Exception as exc:  # noqa: BLE001 (the user's import of transformers must go on)
        warnings.warn(f"vpaged: attn_implementation='vpaged' could not be registered: {exc}", stacklevel=2)


class _AfterModelingUtils(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when transformers.modeling_utils is looked for, it hands back the spec the other
    finders give, with the loader's exec_module wrapped so that registration follows the module's own code."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != WATCHED or not _uninstall(self):
            return None
        spec = importlib.util.find_spec(fullname)  # the remaining finders, as the import would ask them
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_then_register(module):
            if getattr(module, "__name__", None) != WATCHED:  # a loader object shared with other modules
                return run(module)
            try:
                run(module)
            finally:
                loader.__dict__.pop("exec_module", None)  # back to the loader's own method
            _register_or_warn()

        loader.exec_module = exec_then_register
        return spec


_finder = _AfterModelingUtils()


def _uninstall(finder) -> bool:
    """Take the finder off sys.meta_path; False when another thread did first."""
    with _lock:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
            return True
        return False


def register_when_transformers_loads() -> None:
    """Register now if transformers' modeling code is loaded, else as soon as it is (idempotent)."""
    module = sys.modules.get(WATCHED)
    if module is not None and hasattr(module, "AttentionInterface"):
        _register_or_warn()
        return
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def waiting() -> bool:
    """Whether registration still waits for transformers (tests)."""
    return _finder in sys.meta_path
