"""The warnings gym_fork gives its user, as Gymnasium's logger gives them (its level,
``gymnasium.logger.min_level``; its ``WARN:`` and ``ERROR:`` prefixes), but coloured only
where stderr is a terminal: a log file or a pipe gets no escape codes. The message is
never %-formatted (Gymnasium's ``logger.warn(msg)`` raises TypeError for a text holding
a ``%``, such as a sandbox's stderr line quoted in it).
"""

from __future__ import annotations

import sys
import warnings

from gymnasium import logger
from gymnasium.utils import colorize


def _styled(text: str, color: str) -> str:
    stream = sys.stderr
    try:
        terminal = stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        terminal = False
    return colorize(text, color) if terminal else text


def warn(message: str, *, category: type[Warning] | None = None, stacklevel: int = 1) -> None:
    """Warn (``WARN: message``) where Gymnasium's logger level allows warnings;
    ``stacklevel`` 1 names the caller."""
    if logger.min_level <= logger.WARN:
        text = _styled(f"WARN: {message}", "yellow")
        warnings.warn(text, category=category, stacklevel=stacklevel + 1)


def error(message: str, *, stacklevel: int = 2) -> None:
    """Report an error (``ERROR: message``) where Gymnasium's logger level allows it;
    ``stacklevel`` 2 (as Gymnasium's) names the caller's caller."""
    if logger.min_level <= logger.ERROR:
        warnings.warn(_styled(f"ERROR: {message}", "red"), stacklevel=stacklevel + 1)
