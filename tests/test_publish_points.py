"""A crash at any point where a checkpoint is published — an object's write and rename, the manifest's,
the commit, a region slot's header, the memory tier's persist, retention's uncommitting of an older
one — never leaves a state in which the restart picks an incomplete checkpoint or loses the last good
one: every storing strategy, every point it passes, a SIGKILL at an arrival drawn for the pair; the
restart resumes bitwise where the uninterrupted run was, from no older a step than the newest full
checkpoint the directory held committed when the process died."""

from __future__ import annotations

import json
import random

import pytest

from everystep.storage import CheckpointDirectory

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
    arrival = random.Random(_id(case)).randint(1, 2)
    directory = tmp_path / "c"
    killed = run_script(_RUN, strategy, str(directory), json.dumps(options), str(STEPS),
                        env={"EVERYSTEP_CRASH": f"{point}:{arrival}"})
    assert killed.returncode == -9, f"{point} was not reached {arrival} times:\n{killed.stdout[-2000:]}"
    held = CheckpointDirectory.open(directory, access="read")
    try:
        committed = max((m.step for m in held.fulls()), default=0)
    finally:
        held.close()
    w = make("mlp", 0)
    with attach(w, directory, strategy, **{"every": 1, "keep": 2, "final": False, **options}) as ckpt:
        step = ckpt.restore()
        assert live_hash(w, step) == uninterrupted[step], (point, arrival, step, ckpt.recovered)
    assert step >= committed, (point, arrival, step, committed)
