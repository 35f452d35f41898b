"""Whether a checkpoint's compressor is this run's, across thinwire versions.

A saved exchange state names the compressor it was saved with by its ``repr``
(``DGC(density=0.01, momentum=0.9, ...)``): its name and every option the ranks must agree
on. A later thinwire may add an option (``block``, ``keep``); its repr then lists one
more field, and a state saved before would no longer match although it describes the
same compressor, the new option at its default being what the old version did. So two
reprs describe the same compressor where they name the same class with the same values,
apart from options the saved one does not list and this run leaves at their defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: brackets that may enclose commas inside one option's value
_OPENING, _CLOSING = "([{", ")]}"


def option_defaults(compressor: Any) -> dict[str, str]:
    """The ``repr`` of each default of ``compressor``'s options that its repr lists
    (none for a compressor that is not a dataclass)."""
    if not dataclasses.is_dataclass(compressor):
        return {}
    found = {}
    for option in dataclasses.fields(compressor):
        if option.repr and option.default is not dataclasses.MISSING:
            found[option.name] = repr(option.default)
    return found


def same_compressor(saved: str, mine: str, defaults: dict[str, str]) -> bool:
    """Whether ``saved`` (a checkpoint's compressor repr) describes the compressor whose
    repr is ``mine``: equal, or the same class and values except options ``saved`` does
    not list that ``mine`` holds at their ``defaults``."""
    if saved == mine:
        return True
    saved_parts, mine_parts = _parse(saved), _parse(mine)
    if saved_parts is None or mine_parts is None or saved_parts[0] != mine_parts[0]:
        return False
    saved_options, mine_options = saved_parts[1], mine_parts[1]
    if not set(saved_options) <= set(mine_options):
        return False  # an option this version does not know
    for name, value in mine_options.items():
        if name in saved_options:
            if saved_options[name] != value:
                return False
        elif defaults.get(name) != value:
            return False  # added since, and this run does not leave it at its default
    return True


def _parse(text: str) -> tuple[str, dict[str, str]] | None:
    """``Name(a=1, b='x')`` as ``("Name", {"a": "1", "b": "'x'"})``; None where it is
    not of that form."""
    opening = text.find("(")
    if opening <= 0 or not text.endswith(")"):
        return None
    name, body = text[:opening], text[opening + 1 : -1]
    options: dict[str, str] = {}
    for part in _top_level_split(body):
        key, equals, value = part.partition("=")
        if not equals or not key.strip().isidentifier():
            return None
        options[key.strip()] = value.strip()
    return name, options


def _top_level_split(body: str) -> list[str]:
    """``body`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(body):
        if quote:
            if char == quote and body[i - 1] != "\\":
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in _OPENING:
            depth += 1
        elif char in _CLOSING:
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    tail = body[start:]
    if tail.strip():
        parts.append(tail)
    return parts
