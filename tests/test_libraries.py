"""The checkpointing libraries a user would pick today (DLRover's Flash Checkpoint, lm-resiliency,
torch_checkpointing) as baselines of the bench, and the kill-and-resume harness over them.

They are the ``peers`` extra (``make install-peers``): where a library is not installed, the bench
says so as the run's own error, and the tests that run the library are skipped. The measured
figures are in docs/measurements.md ("What you would use instead").
"""

from __future__ import annotations

import pytest

from everystep.eval.bench.command import BenchConfig, report, run_bench
from everystep.eval.bench.libraries import LIBRARIES, missing

pytestmark = pytest.mark.timeout(900)

INSTALLED = [name for name in LIBRARIES if missing(name) is None]


def test_a_library_that_cannot_run_is_reported_as_not_run_with_its_own_error(monkeypatch):
    """A library whose run fails (here: one that cannot be imported) is not dropped: the report
    names it with its error, and the strategies beside it are measured as ever."""
    from everystep.eval.bench import command as bench

    real = bench._run_one

    def failing(cfg, repeat, strategy, every):
        if strategy == "torch_checkpointing":
            raise bench.EverystepError("benchmark run of torch_checkpointing failed:\nImportError: no module")
        return real(cfg, repeat, strategy, every)

    monkeypatch.setattr(bench, "_run_one", failing)
    cfg = BenchConfig(workload="mlp", strategies=("checkfreq", "torch_checkpointing"), steps=4, warmup=1, repeats=2,
                      every=1)
    result = report(cfg, run_bench(cfg, progress=False))
    assert result["not_run"] == {"torch_checkpointing": "benchmark run of torch_checkpointing failed:\n"
                                                        "ImportError: no module"}
    assert set(result["summary"]) == {"none", "checkfreq"}


@pytest.mark.skipif(not INSTALLED, reason="the peers extra is not installed (make install-peers)")
def test_each_installed_library_runs_in_the_bench_beside_everystep_and_restores_its_step():
    """Every step on the mlp, 3 repeats: each library saves, restores the step it saved and says
    where from, its state equal to the live one once restored; none of them resumes bitwise here
    (DLRover and torch_checkpointing keep no RNG or data position; GEMINI takes the caller's state
    in its hook after optimizer.step(), before the scheduler steps), where everystep's does."""
    cfg = BenchConfig(workload="mlp", strategies=("lightcheck", *INSTALLED), steps=6, warmup=1, repeats=1, every=1)
    result = report(cfg, run_bench(cfg, progress=False))
    assert result["not_run"] == {}
    summary = result["summary"]
    for name in INSTALLED:
        s = summary[name]
        recovery = s["recovery_seconds_memory"] if LIBRARIES[name].recovers_from == "memory" else s["recovery_seconds_disk"]
        assert recovery is not None and recovery > 0, name
        assert s["recovery_error"] == 0, name
        assert s["resumes_bitwise"] is False, name
    assert summary["lightcheck"]["resumes_bitwise"] is True


@pytest.mark.long
@pytest.mark.skipif(not INSTALLED, reason="the peers extra is not installed (make install-peers)")
@pytest.mark.parametrize("name", INSTALLED)
def test_a_library_killed_while_its_write_is_in_flight_recovers_what_it_says(name):
    """The kill-and-resume harness (:mod:`everystep.eval.kills.libraries`): SIGKILL right after the
    save of step 7 returns, its write in flight, disk writes every 2 steps, a restart, training on
    to step 12. What each one does, as measured here and written in docs/measurements.md (it
    varies from trial to trial where a background write races the kill): DLRover's saver process
    outlives the training process and serves step 7 from its shared memory, or its disk step 6;
    torch_checkpointing's step 7 dies with its writer and step 6 is restored; GEMINI's node-local
    files restore step 5 or 3. None resumes bitwise."""
    from everystep.eval.kills.libraries import kill_and_resume

    found = {"dlrover": {6, 7}, "torch_checkpointing": {6}, "lm_resiliency": {3, 5}}
    trial = kill_and_resume(name, workload="mlp", steps=12, kill_at=7, disk_every=2)
    assert trial["error"] is None and trial["recovered"] in found[name], trial
    assert trial["lost"] == 7 - trial["recovered"] and trial["bitwise"] is False, trial


@pytest.mark.skipif("dlrover" not in INSTALLED, reason="DLRover is not installed (make install-peers)")
def test_dlrovers_saver_process_serves_its_memory_after_close_and_is_ended_by_end(tmp_path):
    """DLRover starts a saver process of its own, which a bench run (leaving by ``os._exit``) would
    leave behind: ``end`` ends it, after the check's load, which asks it for the memory it holds."""
    from everystep.eval.workloads import build

    w = build("mlp", seed=0, optimizer="adamw")
    flash = LIBRARIES["dlrover"](tmp_path / "c", w, 1)
    try:
        for step in range(1, 4):
            w.loss(w.data.next()).backward()
            w.optimizer.step()
            w.optimizer.zero_grad()
            flash.after_step(step)
        flash.wait()
        flash.close()
        saver = flash._checkpointer._engine.saver_proc
        assert saver is not None and saver.is_alive()
        assert flash.load(build("mlp", seed=0, optimizer="adamw")) == 3
    finally:
        flash.end()
    assert not saver.is_alive()
