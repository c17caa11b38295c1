"""Shared by the config tests: the config built from options, with its deprecation warnings checked, or the
one ConfigError it raises."""

from __future__ import annotations

import warnings

import pytest

from cgcompile.config import CudaGraphConfig, CudaGraphModule
from cgcompile.errors import ConfigError

__all__ = ["M", "error_of", "from_options", "migrate"]


M = CudaGraphModule
from_options = CudaGraphConfig.from_options


def migrate(options):
    """from_options, asserting exactly one FutureWarning per recorded deprecated-spelling migration."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = from_options(options)
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    deprecated = [m for m in config.migrations if m.deprecated]
    assert len(future) == len(deprecated)
    for migration, message in zip(deprecated, future):
        assert str(migration) in message
    return config


def error_of(options) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as excinfo:
            from_options(options)
    return str(excinfo.value)
