"""matplotlib, which only the ``bench`` extra installs, for the commands that draw."""

from __future__ import annotations

import importlib.util
from typing import Any

from ..errors import ConfigError

__all__ = ["pyplot", "check_plotting"]

_MISSING = "--plot draws with matplotlib, which only the bench extra installs: pip install \"everystep[bench]\""


def check_plotting() -> None:
    """Raise :class:`ConfigError` now, before any work, if a figure could not be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(_MISSING)


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files (the Agg backend)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
