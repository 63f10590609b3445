"""Route the ``python_backends`` loggers into Triton's log.

The plain modules under ``python_backends`` log with :mod:`logging` (they must not import
Triton), but nothing in a python-backend stub configures logging: without this their INFO lines
were dropped and their warnings went, unformatted, to the stub's stderr through Python's
last-resort handler. Forwarded to ``pb_utils.Logger`` they land in Triton's log with its
timestamps and levels, next to the lines of the model that caused them.
"""

from __future__ import annotations

import logging

import triton_python_backend_utils as pb_utils

ROOT = "python_backends"


class TritonLogHandler(logging.Handler):
    """Writes each record through ``pb_utils.Logger`` at the matching level."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.ERROR:
                pb_utils.Logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(message)
            elif record.levelno >= logging.INFO:
                pb_utils.Logger.log_info(message)
            else:
                pb_utils.Logger.log_verbose(message)
        except Exception:  # a log line must never fail the request that wrote it
            self.handleError(record)


def route_to_triton_log(model_name: str) -> None:
    """Send the records of every ``python_backends`` logger (INFO and up) to Triton's log, each
    line prefixed with the model and the module. Once per stub process: a second call is a no-op."""
    logger = logging.getLogger(ROOT)
    if any(isinstance(handler, TritonLogHandler) for handler in logger.handlers):
        return
    handler = TritonLogHandler()
    handler.setFormatter(logging.Formatter(f"{model_name} %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # not also to the last-resort handler on stderr
