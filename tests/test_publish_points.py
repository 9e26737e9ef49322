"""A crash at any point where a checkpoint is published — an object's write and rename, the manifest's,
the commit, a region slot's header, the memory tier's persist, retention's uncommitting of an older
one — never leaves a state in which the restart picks an incomplete checkpoint or loses the last good
one: every storing strategy, every point it passes, a SIGKILL at an arrival drawn for the pair; the
restart resumes bitwise where the uninterrupted run was, from no older a step than the newest full
checkpoint the directory (or the strategy's region) held committed when the process died. The kill
comes at a point's third or fourth arrival (retention's first or second, which comes once `keep`
newer checkpoints are there), so that a checkpoint newer than step 0 is always there to recover: a
restore that recovers nothing fails here."""

from __future__ import annotations

import json
import random

import pytest

from pathlib import Path

from everystep.storage import CheckpointDirectory
from everystep.storage.region import Region, region_path

from .forked import run_script
from .test_checkpointer import attach, live_hash, loop, make

STEPS = 12
DIRECTORY = ("store.object.mid_write", "store.object.before_rename", "store.commit.before_manifest",
             "store.manifest.mid_write", "store.manifest.before_rename", "store.retention.uncommitted")
"""The points of a checkpoint written to the directory, and of retention discarding an older one."""
REGION = ("store.region.before_header", "store.region.mid_header")
"""The points of a region slot's commit."""

CASES = [
    *((s, {}, p) for s in ("full_sync", "checkfreq", "async", "checkflow") for p in DIRECTORY),
    *(("gockpt", {"every": 2, "parts": 2}, p) for p in DIRECTORY),
    *(("lightcheck", {"persist_every": 2}, p) for p in (*DIRECTORY, *REGION)),
    *(("checkfreq", {"memory": True, "persist_every": 2}, p) for p in (*DIRECTORY, *REGION, "tier.persist")),
]

_RUN = """
import json, sys
from tests.test_checkpointer import attach, loop, make
strategy, directory, options, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
w = make("mlp", 0)
with attach(w, directory, strategy, **{"every": 1, "keep": 2, **options}) as ckpt:
    ckpt.restore()
    loop(w, ckpt, 0, steps)
"""


@pytest.fixture(scope="module")
def uninterrupted() -> list[str]:
    """The state's hash after each step of the loop without everystep (index: the step)."""
    w = make("mlp", 0)
    hashes = [live_hash(w, 0)]
    for step in range(1, STEPS + 1):
        loop(w, None, step - 1, step)
        hashes.append(live_hash(w, step))
    return hashes


def _id(case) -> str:
    strategy, options, point = case
    return f"{strategy}{'+memory' if options.get('memory') else ''}-{point}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_a_kill_at_any_publish_point_leaves_the_newest_good_checkpoint(tmp_path, shm, uninterrupted, case):
    strategy, options, point = case
    if options.get("memory"):
        options = {**options, "region": f"{shm}/rank-{{rank}}.bin"}
    first = 1 if point == "store.retention.uncommitted" else 3  # (retention comes once `keep` newer ones are there)
    arrival = random.Random(_id(case)).randint(first, first + 1)
    directory = tmp_path / "c"
    killed = run_script(_RUN, strategy, str(directory), json.dumps(options), str(STEPS),
                        env={"EVERYSTEP_CRASH": f"{point}:{arrival}"})
    assert killed.returncode == -9, f"{point} was not reached {arrival} times:\n{killed.stdout[-2000:]}"
    held = CheckpointDirectory.open(directory, access="read")
    try:
        committed = max((m.step for m in held.fulls()), default=0)
    finally:
        held.close()
    committed = max(committed, _newest_in_region(directory, strategy, options))
    assert committed > 0, (point, arrival, "nothing newer than step 0 was committed: the kill proves nothing")
    w = make("mlp", 0)
    with attach(w, directory, strategy, **{"every": 1, "keep": 2, "final": False, **options}) as ckpt:
        step = ckpt.restore()
        assert live_hash(w, step) == uninterrupted[step], (point, arrival, step, ckpt.recovered)
    assert step >= committed, (point, arrival, step, committed)


def _newest_in_region(directory: Path, strategy: str, options: dict) -> int:
    """The newest complete slot of the strategy's region (lightcheck's, the memory tier's), or -1."""
    if strategy != "lightcheck" and not options.get("memory"):
        return -1
    path = region_path(directory, options.get("region"), 0, 1)
    if not path.exists():
        return -1
    region = Region.open(path, access="read")
    try:
        return max((slot.step for slot in region.slots(warn=False)), default=-1)
    finally:
        region.close()
