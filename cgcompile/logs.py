"""Make the "cgcompile" logger answer to TORCH_LOGS="+cgcompile", like torch's own components."""

from __future__ import annotations

import logging
import os

LOGGER_NAME = "cgcompile"


def register_with_torch_logs() -> None:
    """Register our logger with torch._logging so TORCH_LOGS can name it.

    Private torch API (torch._logging._internal.register_log / _init_logs), checked on torch 2.11 and 2.13; if it
    moves, plain `logging.getLogger("cgcompile")` configuration still works.
    """
    try:
        from torch._logging import _internal
        _internal.register_log(LOGGER_NAME, LOGGER_NAME)
        if os.environ.get("TORCH_LOGS") and LOGGER_NAME in os.environ["TORCH_LOGS"]:
            _internal._init_logs()  # TORCH_LOGS was parsed at `import torch`, before we existed
    except Exception as exc:  # pragma: no cover - only on a torch that moved the API
        logging.getLogger(LOGGER_NAME).debug("TORCH_LOGS registration unavailable: %s", exc)
