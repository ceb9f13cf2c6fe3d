"""`vpaged serve --chat-template`: a Jinja chat template in place of a model's own (as vLLM's flag), e.g. for a
model whose tokenizer has none, or one whose template does not render tools (the server otherwise gives such a
model the tools in the Hermes convention: vpaged/serve/http/chat_template.py).

    vpaged serve MODEL --chat-template chatml.jinja
    vpaged serve --model a=DIR_A --model b=DIR_B --chat-template b=chatml.jinja    # model b's only

A bare value is every served model's; NAME=FILE is model NAME's, over a bare one. Each template is checked by
rendering a conversation with it before the server starts; any problem is an InvalidArgumentError in one line.
"""

from __future__ import annotations

import os

from ..errors import InvalidArgumentError


def read_chat_templates(given: list[str] | None, names: list[str]) -> dict[str, tuple[str, str]]:
    """--chat-template values: {model name: (where it came from, the Jinja template)}. `FILE` (or the template
    itself, as vLLM takes it) is every model's; `NAME=FILE` one model's, over a bare one."""
    out: dict[str, tuple[str, str]] = {}
    named: set[str] = set()  # models given a template of their own (NAME=FILE), which a bare one does not replace
    for value in given or []:
        name, sep, rest = value.partition("=")
        own = bool(sep) and name in names
        targets, source = ([name], rest) if own else (names, value)
        if os.path.isfile(source):
            try:
                with open(source, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise InvalidArgumentError(f"--chat-template {source}: cannot read it: {e}") from None
        elif "{{" in source or "{%" in source:
            text = source
        else:
            raise InvalidArgumentError(f"--chat-template {source}: no such file (nor a Jinja template)")
        for target in targets:
            if own or target not in named:
                out[target] = (source, text)
        if own:
            named.add(name)
    return out


def use_chat_templates(engines: dict, templates: dict[str, tuple[str, str]]) -> None:
    """Give each model its --chat-template, checked by rendering a conversation with it."""
    for name, (source, text) in templates.items():
        tokenizer = getattr(engines[name], "tokenizer", None)
        if tokenizer is None:
            raise InvalidArgumentError(f"--chat-template for {name}: this model has no tokenizer")
        before = getattr(tokenizer, "chat_template", None)
        tokenizer.chat_template = text
        try:
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # noqa: BLE001 - a template may raise anything (Jinja syntax, its own checks)
            tokenizer.chat_template = before
            why = " ".join(str(e).split()) or type(e).__name__
            raise InvalidArgumentError(f"--chat-template {source} does not render a conversation: {why}") from None
