"""How a field of an options record is described to a command line: the metadata the CLI's flags are made from.

A record whose fields are options (ServerLimits, ServerOptions, WorkloadSpec, the CLI's own records) gives each
field `metadata=option("help text", ...)`; vpaged/cli/record_flags.py makes one flag per field from it, with
the field's default as the flag's default, so a default and its help are written once, on the record.
serve/config.py's `option` (the engine's fields) writes the same "help" and "choices" keys.
"""

from __future__ import annotations

from collections.abc import Callable


def option(
    help: str,
    choices: tuple | None = None,
    *,
    flag: str | None = None,
    scale: int = 1,
    metavar: str | None = None,
    parse: Callable[[str], object] | None = None,
    repeat: bool = False,
    negated: bool = False,
    default_text: str | None = None,
) -> dict:
    """A field's metadata.

    help: what the option does (--help shows it). choices: its values, for a closed set. flag: its spelling
    when not --<field-name> (max_body_bytes: --max-body-kib). scale: the flag's unit in the field's (the flag
    is in KiB, the field in bytes: 1024); the flag's default is the field's divided by it. metavar: the
    value's name in --help. parse: how a flag's text becomes one value, when not by the field's type.
    repeat: the flag may be given several times, each adding one item. negated: a flag that sets the bool
    field, True by default, to False (--no-progress). default_text: what --help says of the default in its
    place (a default of None means "decided later": say by what).
    """
    return {
        "help": help,
        "choices": choices,
        "flag": flag,
        "scale": scale,
        "metavar": metavar,
        "parse": parse,
        "repeat": repeat,
        "negated": negated,
        "default_text": default_text,
    }
