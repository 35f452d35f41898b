"""Tasks by name: ``thinwire.tasks.task("fashion", batch_size=32)``."""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, TypeVar

from thinwire.tasks.base import Task

_REGISTRY: dict[str, type[Task]] = {}

T = TypeVar("T", bound=type[Task])


def register_task(cls: T) -> T:
    """Class decorator: make the dataclass ``cls`` available under ``cls.name``."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass (its fields are its options)")
    name = cls.name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"task name {name!r} is already taken by {_REGISTRY[name]}")
    _REGISTRY[name] = cls
    return cls


def task(name: str | Task, **options: Any) -> Task:
    """Build the task registered as ``name`` with ``options`` (an instance is returned as it is).

    Unknown names and unknown options raise an error that lists what is available.
    """
    _load_builtin()
    if isinstance(name, Task):
        if options:
            raise ValueError("options were given together with a ready-made task")
        return name
    cls = task_class(name)
    accepted = task_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"task {name!r} has no option(s) {', '.join(unknown)}; "
            f"its options are: {', '.join(sorted(accepted)) or 'none'}"
        )
    hints = _hints(cls) if any(accepted[key] is None for key in options) else {}
    for key, value in options.items():
        _check_kind(name, key, value, accepted[key], hints.get(key))
    return cls(**options)


def _hints(cls: type) -> dict[str, Any]:
    """The task's declared option types, or none where they cannot be resolved (names
    imported only for type checkers): its own checks then stand alone."""
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):
        return {}


#: what an option may be, by the kind of its default, and how to say it
_KINDS: dict[type, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "true or false"),
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    str: ((str, os.PathLike), "a string"),
}


def _check_kind(task_name: str, key: str, value: Any, default: Any, hint: Any = None) -> None:
    """Refuse an option whose kind differs from its default's (a string for an integer,
    say), naming it, before the task compares it with anything. An optional option
    (default ``None``) has the kind its type hint gives besides ``None``."""
    kind = type(default)
    if default is None:
        if value is None:
            return
        declared = [t for t in typing.get_args(hint) if t in _KINDS]
        kind = declared[0] if len(declared) == 1 else type(None)
    if kind not in _KINDS:  # a required option, or a hint of another kind: the task checks
        return
    kinds, described = _KINDS[kind]
    if not isinstance(value, kinds) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(
            f"task {task_name!r}: option {key} must be {described}"
            f"{' or None' if default is None else ''} (default {default!r}), "
            f"got {value!r}"
        )


def tasks() -> dict[str, str]:
    """Every registered task's name and one-line summary, sorted by name."""
    _load_builtin()
    return {name: _REGISTRY[name].summary for name in sorted(_REGISTRY)}


def task_class(name: str) -> type[Task]:
    """The class registered as ``name`` (for documentation and introspection)."""
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown task {name!r}; choose one of: {known}") from None


def task_options(name: str) -> dict[str, Any]:
    """The options of task ``name`` with their defaults (``dataclasses.MISSING``: required)."""
    options: dict[str, Any] = {}
    for field in dataclasses.fields(task_class(name)):
        if field.init:
            factory = field.default_factory
            options[field.name] = field.default if factory is dataclasses.MISSING else factory()
    return options


def _load_builtin() -> None:
    # Importing the package registers the built-in tasks once.
    import thinwire.tasks  # noqa: F401
