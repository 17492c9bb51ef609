"""The guard's logger, under vLLM's so that vLLM's handlers and level apply to it."""

from __future__ import annotations

import logging

LOGGER_NAME = "vllm.prefix_guard"


def logger() -> logging.Logger:
    """vLLM's logger for the guard (configured by vLLM's logging setup when available)."""
    try:
        from vllm.logger import init_logger
    except ImportError:  # pragma: no cover - vLLM missing: doctor reports it
        return logging.getLogger(LOGGER_NAME)
    return init_logger(LOGGER_NAME)
