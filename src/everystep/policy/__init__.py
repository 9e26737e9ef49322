"""When to checkpoint: pure functions on plain numbers, no I/O."""

from .deadline import deadline_margin, deadline_reached
from .lowdiff import LowDiffCosts, lowdiff_optimum, lowdiff_wasted_time, lowdiff_integer_optimum
from .young_daly import young_daly_interval, young_daly_overhead, overhead_at

__all__ = [
    "deadline_margin",
    "deadline_reached",
    "LowDiffCosts",
    "lowdiff_optimum",
    "lowdiff_integer_optimum",
    "lowdiff_wasted_time",
    "young_daly_interval",
    "young_daly_overhead",
    "overhead_at",
]
