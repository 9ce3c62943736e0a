"""Configuration fields that describe their own command-line flag.

A field made with ``option(default, help, ...)`` carries a ``Flag`` in its metadata, so the
record that holds an option (``engine/config.py``) is the one place its default, help text and
flag are written; the CLI (``commands/engine_args.py``) and ``LLM()`` are built from it.
Importable without torch: the CLI builds its help from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

Form = Literal["value", "on", "off", "toggle"]


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line.

    ``value`` takes a value (``parse`` converts it, as argparse's ``type``; ``choices`` bounds
    it); ``on`` is a switch that sets the field True; ``off`` a switch that sets it False
    (``--no-adaptive``); ``toggle`` a ``--flag``/``--no-flag`` pair. ``name`` None is the field's
    name as a flag (``max_batch``: ``--max-batch``).
    """

    help: str
    name: str | None = None
    parse: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    form: Form = "value"

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag's value under."""
        assert self.name is not None
        return self.name.lstrip("-").replace("-", "_")

    def value(self, args: argparse.Namespace) -> Any:
        """The field's value from parsed arguments (an ``off`` switch given is False)."""
        given = getattr(args, self.dest)
        return not given if self.form == "off" else given


def option(
    default: Any,
    help: str,
    *,
    name: str | None = None,
    parse: Callable[[str], Any] = str,
    choices: tuple[str, ...] | None = None,
    form: Form = "value",
) -> Any:
    """A dataclass field with ``default`` and the flag that sets it."""
    flag = Flag(help, name, parse, choices, form)
    return dataclasses.field(default=default, metadata={"flag": flag})


def flags(record: type) -> Iterator[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of a dataclass that have a flag, in order, each with its flag named."""
    for field in dataclasses.fields(record):
        flag = field.metadata.get("flag")
        if flag is not None:
            yield field, dataclasses.replace(flag, name=flag.name or "--" + field.name.replace("_", "-"))
