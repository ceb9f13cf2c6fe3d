"""Flags made from the fields of a record, and the record made back from the parsed flags.

One field, one flag: its spelling, help, choices, unit and parser come from the field's metadata
(vpaged.serve.options.option, for the engine's fields too, with engine_flags.SPELLINGS for their spellings), its
type from the annotation, and for an options record (ServerLimits, ServerOptions, WorkloadSpec, the commands'
records in cli/command_options.py) its default from the field's default:

    add_record_flags(parser, ServerLimits, "limits (checked before any work)")
    limits = record_of(ServerLimits, parser.parse_args(argv))

A flag keeps its value in the field's name and in the field's unit (--max-body-kib 8 gives max_body_bytes
8192), so record_of needs no table; --help shows the default in the flag's unit. engine_flags.py makes the
engine's flags with add_field_flag too.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

_TYPES = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class Spelling:
    """How a field is spelled on the command line when not --<field-name> of its own value."""

    flag: str
    scale: int = 1  # the flag's value times this is the field's (MiB -> bytes)
    negated: bool = False  # a flag that sets the bool field to False
    default: str | None = None  # the CLI's default (parsed as if given) when it differs from the config's
    metavar: str | None = None


def value_type(annotation) -> type:
    """The parser of one flag value of a field annotated so: `int | None` -> int, `tuple[int, ...]` -> int
    (a repeated flag's items); str for any other annotation (a field with its own parser says so)."""
    text = str(annotation).removesuffix(" | None")
    if text.startswith("tuple[") and text.endswith(", ...]"):
        text = text[len("tuple[") : -len(", ...]")]
    return _TYPES.get(text, str)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scaled(parse, scale: int):
    return lambda text: parse(text) * scale


def _one_of(parse, choices):
    """The text must be one of choices (as written), then parse it."""

    def check(text: str):
        if text not in map(str, choices):
            raise argparse.ArgumentTypeError(f"invalid choice {text!r} (one of {', '.join(map(str, choices))})")
        return parse(text)

    return check


def add_field_flag(
    group,
    f: dataclasses.Field,
    spelling: Spelling,
    *,
    dest: str,
    default,
    parse,
    choices=None,
    repeat: bool = False,
    bool_action=argparse.BooleanOptionalAction,
    shown_default: str | None = None,
    help_suffix: str = "",
) -> argparse.Action:
    """The flag of field `f` on `group` (a parser or an argument group), its value kept in `dest`.

    default: argparse's default (in the field's unit); parse: one value's parser (scaled by spelling.scale
    here); a bool field is a switch of bool_action (store_true: on when given), a negated one a store_const
    False; shown_default: the default --help names (in the flag's unit), None for none."""
    help_text = (f.metadata.get("help") or "") + help_suffix
    if spelling.negated:
        return group.add_argument(
            spelling.flag,
            dest=dest,
            action="store_const",
            const=False,
            default=default,
            help=_escaped(f"turn off: {help_text}"),
        )
    if str(f.type) == "bool":
        return group.add_argument(
            spelling.flag, dest=dest, action=bool_action, default=default, help=_escaped(help_text)
        )
    if spelling.scale != 1:
        parse = _scaled(parse, spelling.scale)
    if choices is not None:
        parse = _one_of(parse, choices)
        help_text += f" (one of {', '.join(map(str, choices))})"
    if shown_default is not None:
        help_text += f"; default {shown_default}"
    if spelling.metavar is not None:
        metavar = spelling.metavar
    elif choices is not None:
        metavar = "{" + ",".join(map(str, choices)) + "}"
    else:
        metavar = spelling.flag.lstrip("-").replace("-", "_").upper()
    return group.add_argument(
        spelling.flag,
        dest=dest,
        type=parse,
        default=default,
        action="append" if repeat else "store",
        metavar=metavar,
        help=_escaped(help_text),
    )


def _escaped(help_text: str) -> str:
    return help_text.replace("%", "%%")  # argparse formats help with %


# ---------------------------------------------------------------------------------------------- records


def record_fields(cls) -> list[dataclasses.Field]:
    """The fields of an options record, each with option() metadata (a field without is a mistake: it would
    have no flag, so building the record from flags could never set it)."""
    found = [f for f in dataclasses.fields(cls) if f.init]
    bare = [f.name for f in found if "help" not in f.metadata]
    if bare:
        raise TypeError(f"{cls.__name__}: fields without metadata=option(...): {', '.join(bare)}")
    return found


def spelling_of(f: dataclasses.Field) -> Spelling:
    m = f.metadata
    return Spelling(
        m.get("flag") or flag_name(f.name),
        scale=m.get("scale") or 1,
        negated=bool(m.get("negated")),
        metavar=m.get("metavar"),
    )


def field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default: an option must have one")


def shown_default(f: dataclasses.Field) -> str | None:
    """What --help says of the field's default, in the flag's unit (None: nothing to say)."""
    text = f.metadata.get("default_text")
    if text is not None:
        return text
    default = field_default(f)
    if default is None or isinstance(default, bool) or default == ():
        return None
    scale = f.metadata.get("scale") or 1
    return str(default // scale if scale != 1 else default)


def add_record_flags(p: argparse.ArgumentParser, cls, title: str | None = None) -> None:
    """A flag per field of record class `cls` on `p` (in an argument group named `title` if given); each
    keeps its value in the field's name, in the field's unit, its default the field's."""
    group = p.add_argument_group(title) if title else p
    for f in record_fields(cls):
        m = f.metadata
        spelling = spelling_of(f)
        default = field_default(f)
        if str(f.type) == "bool" and default is not spelling.negated:
            raise TypeError(f"{cls.__name__}.{f.name}: a switch defaults to False (or, negated, to True)")
        repeat = bool(m.get("repeat"))
        add_field_flag(
            group,
            f,
            spelling,
            dest=f.name,
            default=list(default) if repeat and default is not None else default,  # argparse appends to a copy
            parse=m.get("parse") or value_type(f.type),
            choices=m.get("choices"),
            repeat=repeat,
            bool_action="store_true",
            shown_default=shown_default(f),
        )


def record_of(cls, args: argparse.Namespace):
    """The record of class `cls` the flags of add_record_flags(…, cls) gave (a repeated flag's items as a
    tuple); the record's own checks run as it is built."""
    values = {}
    for f in record_fields(cls):
        value = getattr(args, f.name)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)
