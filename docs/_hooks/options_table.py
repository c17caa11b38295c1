"""mkdocs hook: the option table, generated from `CudaGraphConfig`'s fields and its docstring's Attributes.

Why generated: a hand-kept table drifts from the config (an option added, a default changed). A page asks for the
table with the marker below; each row is one dataclass field (name, default as `to_options()` would write it,
the docstring's description), so the docstring is the one place an option is described.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import griffe

from cgcompile.config import CudaGraphConfig
from cgcompile.config_values import plain

MARKER = "<!-- generated: option table -->"
NOT_OPTIONS = {"migrations"}  # a record of what from_options rewrote, not something a user passes


def option_rows() -> list[tuple[str, object, str]]:
    """(option, default, description) per option, in the dataclass's order."""
    sections = griffe.Docstring(inspect.getdoc(CudaGraphConfig)).parse("google")
    described = {item.name: item.description for section in sections if section.kind.value == "attributes"
                 for item in section.value}
    rows = []
    for field in dataclasses.fields(CudaGraphConfig):
        if field.name in NOT_OPTIONS:
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        rows.append((field.name, plain(default), described[field.name]))
    return rows


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, Sphinx roles (:meth:`x`) as plain code spans."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(text.split()))
    return text.replace("|", "\\|")


def _default(value: object) -> str:
    """A default as a user writes it in options: strings bare (`local`), everything else as Python (`[]`)."""
    return f"`{value if isinstance(value, str) else repr(value)}`"


def option_table() -> str:
    lines = ["| option | default | meaning |", "|---|---|---|"]
    for name, default, description in option_rows():
        lines.append(f"| `{name}` | {_default(default)} | {_cell(description)} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_kwargs) -> str:
    return markdown.replace(MARKER, option_table()) if MARKER in markdown else markdown
