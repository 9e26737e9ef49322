"""What the GPU check (:mod:`everystep.eval.gpu_check`) runs, and how much: the strategies of each
part, the papers' targets it compares with, and the sizes and time boxes on a GPU and in a dry run."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Sizes", "GPU", "DRY", "EVERY_STEP", "SPREAD", "ASYNC_O", "GOCKPT_TARGETS", "LIGHTCHECK_TARGET", "PARTS",
           "INTERRUPT_GRACE", "MIB"]

EVERY_STEP = ("torch_save", "dcp_async", "checkfreq", "async", "lightcheck", "checkflow", "lowdiff_plus")
"""Checkpointing every step (``lowdiff_plus``: its replica every step, persisted at its own interval)."""
SPREAD = ("gockpt", "gockpt_o", "async", "checkfreq")
"""Checkpointing every :attr:`Sizes.spread_every` steps."""
ASYNC_O = "checkfreq"
"""GoCkpt's paper's Async-O: the snapshot overlaps a step (``async`` is its Async, whose snapshot blocks)."""
GOCKPT_TARGETS = {"gockpt": 0.42, "gockpt_o": 0.14}
"""GoCkpt's paper: its checkpointing time 57.7-70.1% and GoCkpt-O's 86.4-99.2% below Async-O's."""
LIGHTCHECK_TARGET = 10.0
"""LightCheck's paper: more than 10× CheckFreq's checkpoint frequency within the overhead budget."""
PARTS = ("tests", "bandwidth", "bench", "frequency")
INTERRUPT_GRACE = 20.0
"""Seconds pytest is given, interrupted at the end of its box, to report the tests that ran."""
MIB = 2**20


@dataclass(frozen=True)
class Sizes:
    """How much each part does, and the seconds it may take."""

    workload: str
    device: str
    steps: int
    """Steps of a bench run, :attr:`warmup` of them left out of the timing."""
    warmup: int
    repeats: int
    """Interleaved repeats of the bench, at most: fewer when the box would be passed."""
    spread_every: int
    spread_parts: int
    copy_bytes: int
    copies: int
    """Copies timed per row of the bandwidth table (the median is reported)."""
    budget: float = 0.035
    frequency_cap: int = 16
    """The largest interval the frequency search tries."""
    frequency_repeats: int = 3
    test_workers: int = 0
    """pytest-xdist workers for the CUDA tests (0: none), where it can be imported."""
    boxes: dict[str, float] = field(default_factory=dict)
    """Seconds each part may take (:data:`PARTS`); ``memory`` is read from the bench's runs."""

    @property
    def spread_warmup(self) -> int:
        """Steps of a run every :attr:`spread_every` steps left out of the timing: through the first
        two checkpoints, spread or not. A strategy's pool makes its second host buffer when a
        checkpoint begins while the one before is still written, and allocating pinned memory costs
        some 200 ms for gpt2-small's state: once in a long run, so not in its steady state."""
        return 2 * self.spread_every + self.spread_parts + 1

    @property
    def spread_steps(self) -> int:
        """Steps of a run every :attr:`spread_every` steps: three intervals timed after the warm-up."""
        return self.spread_warmup + 3 * self.spread_every


GPU = Sizes(workload="gpt2-small", device="cuda", steps=25, warmup=5, repeats=3, spread_every=8, spread_parts=7,
            copy_bytes=256 * MIB, copies=5, frequency_cap=128, frequency_repeats=2, test_workers=4,
            boxes={"tests": 120, "bandwidth": 30, "bench": 330, "frequency": 60})
"""On one H100: gpt2-small's 25 ms steps and 265 MiB of state. 540 s of boxes (what a part leaves of
its box goes to the next), 9 minutes with the report. A round of the bench takes about 125 s there
(the runs every K steps train through two checkpoints first), so three rounds need what the tests
and the bandwidth leave of theirs on top of the bench's own box. The frequency search goes
up to a checkpoint every 128 steps (a probe trains 2 intervals: 261 steps, about 7 s): CheckFreq
writing 265 MiB to a disk each time needs about that many steps of 25 ms to stay within 3.5%."""
DRY = Sizes(workload="mlp", device="cpu", steps=8, warmup=2, repeats=1, spread_every=3, spread_parts=2,
            copy_bytes=4 * MIB, copies=3, frequency_cap=2, frequency_repeats=1,
            boxes={"tests": 120, "bandwidth": 30, "bench": 240, "frequency": 120})
"""The same pipeline on the CPU with a tiny workload; every figure real, none meaningful."""
