"""Module tags: which module is an "attn", "moe_router", ... region, and which is never captured.

A tag lives on the module's class, so it shows up in the `nn_module_stack` metadata that Dynamo attaches
to every FX node (the stack records each module's path and class). Tagging one instance swaps its class for a
generated subclass that carries the tag, the same trick torch.nn.utils.parametrize uses: `isinstance`,
`state_dict`, behaviour and `copy.deepcopy` are unaffected, and the original class comes back on untag.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping, TypeVar

import torch.nn as nn

from .errors import ConfigError

__all__ = ["tag", "tag_modules", "eager_region", "untag", "tag_of", "is_eager_region"]

_TAG_ATTR = "_cgcompile_tag"
_EAGER_ATTR = "_cgcompile_eager"
_GENERATED_ATTR = "_cgcompile_generated_from"

M = TypeVar("M")

# (original class, tag, eager) -> generated subclass; one class per combination keeps type identity stable,
# which Dynamo's guards and pickling-by-reference in deepcopy both rely on.
_generated: dict[tuple[type, str | None, bool], type] = {}


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"tag name {name!r} is not valid: use a Python identifier such as 'attn' or 'moe_router'")
    return name


def _base_class(cls: type) -> type:
    return cls.__dict__.get(_GENERATED_ATTR, cls)


def _retag_instance(module: nn.Module, tag: str | None, eager: bool) -> None:
    base = _base_class(type(module))
    if tag is None and not eager:
        module.__class__ = base
        return
    key = (base, tag, eager)
    cls = _generated.get(key)
    if cls is None:
        cls = type(base.__name__, (base,), {
            _TAG_ATTR: tag, _EAGER_ATTR: eager, _GENERATED_ATTR: base,
            "__module__": base.__module__, "__qualname__": base.__qualname__,
        })
        _generated[key] = cls
    module.__class__ = cls


def _apply(obj: M, *, tag: str | None = None, eager: bool | None = None) -> M:
    """Set the tag and/or the eager mark on a module class or instance."""
    if isinstance(obj, type):
        if not issubclass(obj, nn.Module):
            raise TypeError(f"cgcompile tags apply to nn.Module classes or instances, got class {obj.__qualname__}")
        if tag is not None:
            setattr(obj, _TAG_ATTR, tag)
        if eager is not None:
            setattr(obj, _EAGER_ATTR, eager)
        return obj
    if not isinstance(obj, nn.Module):
        raise TypeError(f"cgcompile tags apply to nn.Module classes or instances, got {type(obj).__name__}")
    new_tag = tag if tag is not None else tag_of(obj)
    new_eager = eager if eager is not None else is_eager_region(obj)
    _retag_instance(obj, new_tag, new_eager)
    return obj


def tag(name: str):
    """Decorator marking an nn.Module class (all instances) or one instance as a region named `name`.

    `@cgcompile.tag("attn") class SelfAttention(nn.Module)` or `cgcompile.tag("moe_router")(layer.router)`.
    """
    _check_name(name)
    return lambda obj: _apply(obj, tag=name)


def eager_region(obj: M) -> M:
    """Mark a module class or instance as never captured: its ops always run eagerly."""
    return _apply(obj, eager=True)


def untag(obj: M) -> M:
    """Remove a tag and eager mark set by `tag` / `eager_region` / `tag_modules` from a class or instance."""
    if isinstance(obj, type):
        for attr in (_TAG_ATTR, _EAGER_ATTR):
            if attr in obj.__dict__:
                delattr(obj, attr)
        return obj
    if isinstance(obj, nn.Module):
        obj.__class__ = _base_class(type(obj))
        # a class-level tag (decorator) stays: untag the class for that
        return obj
    raise TypeError(f"cgcompile.untag takes an nn.Module class or instance, got {type(obj).__name__}")


def tag_modules(model: nn.Module, patterns: Mapping[str, str]) -> nn.Module:
    """Tag submodules of `model` whose qualified name matches an fnmatch pattern, e.g. {"layers.*.attn": "attn"}.

    Every pattern must match at least one module: a silent no-op would leave the user wondering why nothing
    is captured.
    """
    names = [n for n, _ in model.named_modules() if n]
    for pattern, name in patterns.items():
        _check_name(name)
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            sample = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ConfigError(f"tag_modules pattern {pattern!r} (tag {name!r}) matches no submodule of "
                              f"{type(model).__name__}; module names look like: {sample}")
        for qualified in matched:
            _apply(model.get_submodule(qualified), tag=name)
    return model


def tag_of(module_or_class) -> str | None:
    """The tag of a module instance or class (an instance tag wins over its class's), or None."""
    return getattr(module_or_class, _TAG_ATTR, None)


def is_eager_region(module_or_class) -> bool:
    """Whether the module (instance or class) was marked with `eager_region`."""
    return bool(getattr(module_or_class, _EAGER_ATTR, False))
