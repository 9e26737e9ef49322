"""Sizes and rates as a person types them: ``16GB/s``, ``500MB/s``, ``2.5e10``, ``80GiB``, ``4 MiB``.

Decimal prefixes (kB, MB, GB, TB: powers of 1000) and binary ones (KiB, MiB, GiB, TiB: powers of
1024), ``B`` optional after a prefix, ``/s`` on a rate. A number without a unit is in the flag's own
unit (bytes, bytes/s or MiB); one too small to be meant in that unit is refused with what was
probably meant.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "UnitError"]

_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:([kmgt]i?)b?|(b))?\s*(/s)?\s*$", re.IGNORECASE)


class UnitError(ValueError):
    """A size or rate that could not be read, or is implausible without a unit."""


def parse_bytes(text: str, *, rate: bool, unit: float = 1.0, plausible: float = 0.0) -> float:
    """Bytes (``rate``: bytes/s) that ``text`` says. A bare number is in ``unit`` bytes, and must
    reach ``plausible`` bytes once in that unit (else it was probably meant with a prefix)."""
    found = _QUANTITY.match(text)
    if not found:
        raise UnitError(f"expected a number with an optional unit such as {'16GB/s or 500MB/s' if rate else '80GiB or 4MiB'};"
                        f" got {text!r}")
    number, prefix, plain_b, per_second = found.groups()
    if per_second and not rate:
        raise UnitError(f"a size takes no /s; got {text!r}")
    value = float(number)
    if not math.isfinite(value) or value <= 0:
        raise UnitError(f"must be above 0; got {text!r}")
    if prefix is None and plain_b is None and not per_second:  # a bare number: the flag's own unit
        value *= unit
        if value < plausible:
            hint = f"{number}GB/s" if rate else f"{number}GiB"
            raise UnitError(f"{text} {'bytes/s' if unit == 1 and rate else 'bytes' if unit == 1 else 'MiB'} is "
                            f"implausibly small; give a unit, e.g. {hint}")
        return value
    return value * _PREFIX[(prefix or "").lower()]
