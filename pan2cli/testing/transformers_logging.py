"""`quiet_transformers`: transformers' own reports silenced, for the scripts and tests that use it as an oracle or a
checkpoint writer (pan2 itself never imports transformers)."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hide transformers' load reports, progress bars and fallback notes (pan2 prints its own lines)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
