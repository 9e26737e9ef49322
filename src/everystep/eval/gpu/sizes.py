"""What the GPU check (:mod:`everystep.eval.gpu.check`) runs, and how much: the strategies of each
part, the targets it compares with, the sizes and time boxes on a GPU and in a dry run, and a box's clock."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

__all__ = ["Sizes", "GPU", "DRY", "EVERY_STEP", "ONCE", "SPREAD", "ASYNC_O", "GOCKPT_TARGETS", "LIGHTCHECK_TARGET", "PARTS",
           "INTERRUPT_GRACE", "MIB", "COMPRESSED", "BOUND", "EVERY_STEP_TARGETS", "BOUND_TARGETS", "Box", "failure",
           "MEMORY_TIER", "BOUND_MEMORY_TIER", "DEVICE_SNAPSHOT", "PLAN_TARGET", "ALL_PARTS", "REGIME"]

EVERY_STEP = ("torch_save", "dcp_async", "checkfreq", "async", "lightcheck", "checkflow", "lowdiff_plus", "lowdiff")
"""Checkpointing every step (``lowdiff_plus``: its replica every step, persisted at its own interval;
``lowdiff``: a differential every step, b of them in each write, a full checkpoint every F steps:
:attr:`Sizes.lowdiff_every` and :attr:`Sizes.lowdiff_batch`)."""
ONCE = ("torch_save", "dcp_async", "checkfreq", "async", "checkflow")
"""Of :data:`EVERY_STEP`, those that write the whole state to the directory every step: bound by the
disk, not by anything a round more would resolve, so measured in the first round only (as are the
device-snapshotting CheckFreq and the runs every K steps to the directory)."""
COMPRESSED = {"lowdiff": "topk:0.01"}
"""The strategies that reuse the gradient compression training runs with, and the compression (the
paper's setting): each one's overhead is over a ``none`` run with that compression (``none+topk:0.01``)."""
BOUND = ("lightcheck", "lowdiff_plus", "lowdiff")
"""The strategies built to take every step, measured on the GPU-bound workload too."""
MEMORY_TIER = ("checkfreq", "checkflow")
"""Strategies that write the whole state, measured every step with their memory tier too
(``NAME+memory``: every checkpoint into a region in memory, the directory at the interval the disk takes)."""
BOUND_MEMORY_TIER = ("checkfreq",)
"""Those measured so on the GPU-bound workload too."""
DEVICE_SNAPSHOT = "checkfreq/device"
"""CheckFreq snapshotting on the device before copying out (``snapshot="device"``): the baseline
Checkflow compares its device memory with."""
PLAN_TARGET = 0.10
"""Checkflow's planned peak device memory within this fraction of its run's (``max_memory_allocated``)."""
EVERY_STEP_TARGETS = {"lightcheck": 0.10, "lowdiff_plus": 0.10, "lowdiff": 0.10,
                      **{f"{name}+memory": 0.10 for name in MEMORY_TIER}}
"""The most each may cost every step on the short-step workload (gpt2-small)."""
BOUND_TARGETS = {"lightcheck": 0.03, "lowdiff_plus": 0.05, "lowdiff": 0.03,
                 **{f"{name}+memory": 0.03 for name in BOUND_MEMORY_TIER}}
"""The most each may cost every step on the GPU-bound workload: LightCheck's paper ≤ 4%, LowDiff+'s
5.1–7.2% without compression, LowDiff's 2.4–3.1%."""
SPREAD = ("gockpt", "gockpt_o", "async", "checkfreq")
"""Checkpointing every :attr:`Sizes.spread_every` steps."""
ASYNC_O = "checkfreq"
"""GoCkpt's paper's Async-O: the snapshot overlaps a step (``async`` is its Async, whose snapshot blocks)."""
GOCKPT_TARGETS = {"gockpt": 0.42, "gockpt_o": 0.14}
"""GoCkpt's paper: its checkpointing time 57.7-70.1% and GoCkpt-O's 86.4-99.2% below Async-O's."""
LIGHTCHECK_TARGET = 10.0
"""LightCheck's paper: more than 10× CheckFreq's checkpoint frequency within the overhead budget."""
PARTS = ("bandwidth", "bench", "bound", "frequency")
"""The parts one call runs by default (``memory`` is read from the bench's runs)."""
ALL_PARTS = ("tests", *PARTS, "regime")
"""With ``tests``, the CUDA tests (``--parts tests``), and ``regime``, GoCkpt where its copy spans
several steps (``--parts regime``): each a call of its own."""
REGIME = ("gockpt", "gockpt_o", "checkfreq")
"""GoCkpt, GoCkpt-O and Async-O (``checkfreq``) every :attr:`Sizes.regime_every` steps on
:attr:`Sizes.regime_workload`, whose state takes several steps to copy."""
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
    bound_workload: str = "gpt2-medium"
    """The GPU-bound workload of the ``bound`` part (:data:`BOUND` every step)."""
    bound_steps: int = 12
    bound_warmup: int = 4
    regime_workload: str = "gpt2-medium"
    """The ``regime`` part's: a state of 4 GiB (336M parameters with AdamW's state), several steps to copy."""
    regime_samples: int | None = 1
    """Its samples a step (None: the workload's batch): a short step, so that the copy spans several."""
    regime_every: int = 50
    """A checkpoint every this many steps, as GoCkpt's paper measures."""
    lowdiff_every: int = 50
    """LowDiff's F, a full checkpoint every this many steps: its runs time F steps after the warm-up,
    so that one full checkpoint is among them, its cost spread over F as in a long run."""
    lowdiff_batch: int = 8
    """LowDiff's b, the differentials written together: one write every b steps (its paper's Table I
    finds b = 2 best for a disk that takes a write per step; a 25 ms step needs fewer, larger writes)."""
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
    def regime_warmup(self) -> int:
        """The ``regime`` part's runs are timed after their first two checkpoints (K at most 7)."""
        return 2 * self.regime_every + 8

    @property
    def regime_steps(self) -> int:
        """Two intervals timed after the warm-up."""
        return self.regime_warmup + 2 * self.regime_every

    @property
    def spread_steps(self) -> int:
        """Steps of a run every :attr:`spread_every` steps: three intervals timed after the warm-up."""
        return self.spread_warmup + 3 * self.spread_every


GPU = Sizes(workload="gpt2-small", device="cuda", steps=25, warmup=5, repeats=3, spread_every=8, spread_parts=7,
            copy_bytes=256 * MIB, copies=5, frequency_cap=128, frequency_repeats=2, test_workers=4,
            boxes={"tests": 100, "bandwidth": 25, "bench": 330, "bound": 150, "frequency": 45, "regime": 540})
"""On one H200: gpt2-small's 25 ms steps and 265 MiB of state. The default parts' boxes are 550 s
(what a part leaves of its box goes to the next), 9 minutes with the report; the CUDA tests are a
call of their own (``--parts tests``: the whole 550 s). The bench's first round took 178 s there
(17 runs of about ten seconds, most of it starting CUDA and the model and checking the resume); the
rounds after it check nothing and leave out the runs bound by the disk (:data:`ONCE`). The ``bound``
part runs gpt2-medium (336M parameters, 4 GiB of state with AdamW's) for 12 steps (LowDiff: F steps
after the warm-up). The frequency search goes up to a checkpoint every 128 steps (a probe trains 2
intervals: 261 steps, about 7 s): CheckFreq writing 265 MiB to a disk each time needs about that
many steps of 25 ms to stay within 3.5%."""
DRY = Sizes(workload="mlp", device="cpu", steps=8, warmup=2, repeats=3, spread_every=3, spread_parts=2,
            copy_bytes=4 * MIB, copies=3, frequency_cap=2, frequency_repeats=1, bound_workload="mlp", bound_steps=6,
            bound_warmup=2, regime_workload="mlp", regime_samples=None, regime_every=3, lowdiff_every=4, lowdiff_batch=2,
            boxes={"tests": 120, "bandwidth": 30, "bench": 240, "bound": 120, "frequency": 120, "regime": 120})
"""The same pipeline on the CPU with a tiny workload; every figure real, none meaningful."""


class Box:
    """A part's time box: the seconds left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def used(self) -> float:
        return time.monotonic() - self.start


def failure(part: str, what: str, error: BaseException | str) -> dict[str, str]:
    """A failure as the report keeps it: the part, what failed, and its traceback (or message)."""
    text = error if isinstance(error, str) else "".join(traceback.format_exception(error)).strip()
    return {"part": part, "what": what, "traceback": text}
