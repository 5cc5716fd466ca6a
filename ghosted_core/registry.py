"""What every name → function registry shares: a signature check at import, one-line lookups."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from typing import TypeVar

from ghosted_core.errors import GhostedError

T = TypeVar("T")


def check_signature(fn: Callable, what: str, params: Mapping[str, type | None], returns: type | None = None) -> None:
    """Refuse, when the module is imported, a registered function whose parameter names (and the
    annotations given in `params`, and its return annotation) differ from what the registry calls."""
    hints = typing.get_type_hints(fn)
    names = list(inspect.signature(fn).parameters)
    wrong = names != list(params) or any(t is not None and hints.get(p) is not t for p, t in params.items()) \
        or returns is not None and hints.get("return") is not returns
    if wrong:
        shown = ", ".join(f"{p}: {t.__name__}" if t else p for p, t in params.items())
        raise TypeError(f"{what}: signature must be ({shown})" + (f" -> {returns.__name__}" if returns else ""))


def add(table: dict[str, T], name: str, entry: T, what: str) -> None:
    """Register `entry` under `name`, refusing a second registration of the same name."""
    if name in table:
        raise ValueError(f"{what} {name!r} is registered twice")
    table[name] = entry


def lookup(table: Mapping[str, T], name: str, what: str) -> T:
    """`table[name]`, or a GhostedError that lists the known names."""
    if name not in table:
        raise GhostedError(f"unknown {what} {name!r}; known: {', '.join(table)}")
    return table[name]
