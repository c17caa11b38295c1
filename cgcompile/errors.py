"""Exceptions that are part of cgcompile's public API."""


class ConfigError(ValueError):
    """Invalid or contradictory backend options.

    A ValueError so callers that already guard option parsing with ``except ValueError`` keep working;
    the message names the offending option(s) and value(s) and says how to fix them.
    """
