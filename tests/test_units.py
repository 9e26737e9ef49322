"""Sizes and rates as a person types them, in the command line and in strategy options."""

from __future__ import annotations

import pytest

from everystep.errors import ConfigError
from everystep.strategies import create
from everystep.units import UnitError, parse_bytes

from .conftest import call_cli


@pytest.mark.parametrize("text, rate, expected", [
    ("16GB/s", True, 16e9), ("500MB/s", True, 5e8), ("500 mb/s", True, 5e8), ("2.5e10", True, 2.5e10),
    ("1GiB/s", True, 2**30), ("64kB/s", True, 64e3), ("3e9B/s", True, 3e9),
    ("80GiB", False, 80 * 2**30), ("4 MiB", False, 4 * 2**20), ("3GB", False, 3e9), ("4096", False, 4096),
    ("1.5TB", False, 1.5e12), ("12B", False, 12),
])
def test_a_size_or_rate_reads_with_or_without_its_unit(text, rate, expected):
    assert parse_bytes(text, rate=rate) == pytest.approx(expected)


@pytest.mark.parametrize("text, rate, message", [
    ("16", True, "16 bytes/s is implausibly small; give a unit, e.g. 16GB/s"),
    ("4GB/s", False, "a size takes no /s"), ("fast", True, "expected a number with an optional unit"),
    ("0GB/s", True, "must be above 0"), ("-3MB", False, "expected a number"), ("16 GB/h", True, "expected a number"),
])
def test_what_cannot_be_read_or_is_implausible_is_refused_with_a_hint(text, rate, message):
    with pytest.raises(UnitError, match=message):
        parse_bytes(text, rate=rate, plausible=1e5 if rate else 0)


def test_a_bare_number_is_in_the_flags_own_unit():
    assert parse_bytes("16", rate=False, unit=2**20) == 16 * 2**20


def test_plan_takes_a_bandwidth_with_its_unit_and_refuses_a_bare_16(capsys):
    base = ("plan", "--step-seconds", "0.5", "--size-bytes", "3GB", "--mtbf", "3600")
    code, with_unit, _ = call_cli(capsys, *base, "--bandwidth", "1GB/s")
    assert code == 0
    assert call_cli(capsys, *base, "--bandwidth", "1e9")[1] == with_unit
    code, _, err = call_cli(capsys, *base, "--bandwidth", "16")
    assert code == 2 and "--bandwidth: 16 bytes/s is implausibly small; give a unit, e.g. 16GB/s" in err


def test_strategy_options_take_units_and_refuse_a_rate_without_one():
    config = create("checkflow", bandwidth="16GB/s", per_size="4MiB", memory_limit="1GiB").config
    assert (config.bandwidth, config.per_size, config.memory_limit) == (16e9, 4 * 2**20, 2**30)
    assert create("gockpt", chunk_bytes="1MiB").config.chunk_bytes == 2**20
    with pytest.raises(ConfigError, match=r"bandwidth=16 is 16 bytes/s, implausibly small; give a unit, e.g. "
                                          r"bandwidth='16GB/s'"):
        create("checkflow", bandwidth=16)
    with pytest.raises(ConfigError, match="per_size: a size takes no /s"):
        create("checkflow", per_size="4MB/s")
