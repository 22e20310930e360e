"""The eval / demo progress bar, with warnings printed above it instead of through it.

A warning written straight to stderr while the bar is drawn lands after the bar's text on the
same line (the bar is redrawn with a carriage return, no newline): the demo's fidelity warnings
cut the bar mid-line. Inside :func:`progress_bar`, Python warnings (``warnings.warn``: the
cache's :class:`~kv_cache.FidelityWarning`) and log records of the console handlers (the
``kv_cache`` loggers through the root one, and transformers' own) go through ``tqdm.write``,
which clears the bar, prints the line and draws the bar again below it. Nothing is silenced: the
same text, filtered by the same ``warnings`` filters and log levels, in the same order.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int) -> Iterator[Callable[[int, str], None]]:
    """A tqdm bar of ``total`` samples on stderr; yields ``progress(n, what)`` (advance by ``n``,
    show ``what``). Warnings and console log lines raised meanwhile print above the bar."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    bar = tqdm(total=total, unit="sample", dynamic_ncols=True)

    def progress(n: int, what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(n)

    shown = warnings.showwarning

    def show_above_bar(message, category, filename, lineno, file=None, line=None):
        if file is not None and file is not sys.stderr:  # written elsewhere on purpose: leave it
            return shown(message, category, filename, lineno, file, line)
        tqdm.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file=sys.stderr)

    # the root logger (kv_cache's loggers propagate to it), and transformers' if it prints itself
    # (it does not propagate); a logger with no console handler of its own is left as it is
    hf = logging.getLogger("transformers")
    loggers = [logging.root] + ([hf] if any(_is_console(h) for h in hf.handlers) else [])
    warnings.showwarning = show_above_bar
    try:
        with logging_redirect_tqdm(loggers=loggers):
            yield progress
    finally:
        warnings.showwarning = shown
        bar.close()


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)
