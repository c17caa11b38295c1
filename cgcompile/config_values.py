"""Parsing of single option values (choices, integers, booleans) into normalized ones, and their display.

Each parser names the option in its :class:`~cgcompile.errors.ConfigError`, so a bad value is reported with
the option it came from and the valid choices. Pure: no torch import.
"""

from __future__ import annotations

import difflib
import enum
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ConfigError


class ChoiceEnum(str, enum.Enum):
    """A str enum: members equal and print as their value; lookup also takes names, case-insensitively."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def _missing_(cls, value: object) -> ChoiceEnum | None:
        if isinstance(value, str):
            folded = value.strip().lower()
            for member in cls:
                if folded in (member.value, member.name.lower()):
                    return member
        return None

    @classmethod
    def choices(cls) -> list[str]:
        """The accepted values, in declaration order (for messages and docs)."""
        return [member.value for member in cls]


def enum_text(value: enum.Enum) -> str:
    """Someone else's enum member (e.g. Megatron's, whose values are ints): its str value, else its name."""
    return value.value if isinstance(value.value, str) else value.name


def parse_enum(option: str, value: Any, enum_cls: type[ChoiceEnum]) -> Any:
    if isinstance(value, enum_cls):
        return value
    choices = enum_cls.choices()
    if isinstance(value, enum.Enum):
        text = enum_text(value)
    elif isinstance(value, str):
        text = value
    else:
        raise ConfigError(
            f"{option} must be one of {', '.join(map(repr, choices))}, got {value!r} ({type(value).__name__})"
        )
    try:
        return enum_cls(text)
    except ValueError:
        close = difflib.get_close_matches(text.strip().lower(), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        raise ConfigError(
            f"{option}={text!r} is not a valid choice{hint} valid choices: {', '.join(map(repr, choices))}"
        ) from None


def parse_int(option: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        number = None
    else:
        try:
            number = operator.index(value)
        except TypeError:
            number = None
    if number is None:
        raise ConfigError(f"{option} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    if number < minimum:
        raise ConfigError(f"{option} must be >= {minimum}, got {number}")
    return number


def parse_bool(option: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{option} must be True or False, got {value!r} ({type(value).__name__})")


def plain(value: Any) -> Any:
    """Enums -> their string, tuples -> lists, mappings -> dicts (for to_options)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [plain(item) for item in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value


def show_list(items: Sequence[Any]) -> str:
    return repr([plain(item) for item in items])
