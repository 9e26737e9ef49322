"""Test the tests: put deliberate bugs into a scratch copy, one at a time, and run the tests that must
catch each. ``make test-mutations`` runs it; it exits 1 when a bug survives.

A bug is caught when every test named for it fails (an error in a fixture or in collection is not
a catch: it proves nothing about the assertion). Each bug is a textual replacement that must match
the source exactly once, so that a refactoring that moves the code is reported, not silently
skipped. The scratch copy is the checkout's tracked and untracked files; the tests run there with
its ``src/`` first on the path, under this interpreter.

    python tools/mutations.py                 # every bug
    python tools/mutations.py --only remote-oldest,peers-oldest
    python tools/mutations.py --list          # the bugs and their tests, nothing run
    python tools/mutations.py --json out.json # also write the results
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, kw_only=True)
class Mutation:
    """One deliberate bug: ``before`` replaced by ``after`` in ``path``; ``tests`` must all fail."""

    name: str
    what: str
    path: str
    before: str
    after: str
    tests: tuple[str, ...]


def cases(test: str, *ids: str) -> tuple[str, ...]:
    """The node ids of ``test`` with each of the parameter ``ids``."""
    return tuple(f"{test}[{i}]" for i in ids)


KILLS = (
    "tests/test_strategies.py::test_killed_runs_recover_the_uninterrupted_runs_state",
    "tests/test_publish_points.py::test_a_kill_at_any_publish_point_leaves_the_newest_good_checkpoint",
    "tests/test_distributed.py::test_a_killed_rank_and_the_restarted_job_recover_bitwise",
    "tests/test_distributed.py::test_naive_diff_on_two_ranks_restarts_every_rank_from_the_same_lossy_state",
    "tests/test_distributed.py::test_four_ranks_restart_bitwise_when_ddp_keeps_its_first_buckets",
    "tests/test_sharded.py::test_fsdp2_ranks_killed_and_restarted_recover_bitwise",
    "tests/test_sharded.py::test_zero1_ranks_killed_and_restarted_recover_bitwise",
    "tests/test_sharded.py::test_hsdp_on_four_ranks_killed_and_restarted_recovers_bitwise",
    "tests/test_s3_tier.py::test_a_job_whose_machine_is_lost_resumes_on_a_new_one_from_the_remote_bitwise",
    "tests/test_peers.py::test_a_host_lost_again_and_again_recovers_from_its_peers_memory_bitwise",
    "tests/test_node_local.py::test_hosts_restarted_in_place_resume_from_their_own_disks_bitwise",
)
"""The kill-and-resume tests of the shared suites, the two-rank jobs, the sharded layouts, the
remote tier and the peers: each must fail when recovery recovers nothing."""

MUTATIONS = (
    Mutation(
        name="lightning-position-behind",
        what="the Lightning integration records its data position one batch behind: a mid-epoch resume retrains a batch",
        path="src/everystep/integrations/lightning.py",
        before='"samples": in_epoch * batch_size,',
        after='"samples": (in_epoch - 1) * batch_size,',
        tests=cases("tests/test_integrations.py::test_killed_and_resumed_equals_the_trainer_alone",
                    "lightning-lowdiff_plus-8-resumes0"),
    ),
    Mutation(
        name="transformers-position-behind",
        what="the Hugging Face trainer resumes one batch behind its step: a mid-epoch resume retrains a batch",
        path="src/everystep/integrations/transformers.py",
        before="step % self._per_epoch * self.args.gradient_accumulation_steps)",
        after="step % self._per_epoch * self.args.gradient_accumulation_steps - 1)",
        tests=cases("tests/test_integrations.py::test_killed_and_resumed_equals_the_trainer_alone",
                    "transformers-checkfreq-8-resumes1"),
    ),
    Mutation(
        name="restore-nothing",
        what="recovery returns nothing: Checkpointer.restore() never asks the strategy",
        path="src/everystep/checkpointer.py",
        before="candidate = self.strategy.recover()",
        after="candidate = None",
        tests=KILLS,
    ),
    Mutation(
        name="remote-oldest",
        what="the remote tier pulls its oldest checkpoint, not its newest",
        path="src/everystep/storage/remote/tier.py",
        before="records = sorted(self._fulls(), key=lambda r: -r.manifest.step)",
        after="records = sorted(self._fulls(), key=lambda r: r.manifest.step)",
        tests=("tests/test_s3_tier.py::test_a_job_whose_machine_is_lost_resumes_on_a_new_one_from_the_remote_bitwise",),
    ),
    Mutation(
        name="pull-read-again",
        what="the restore reads a checkpoint the remote tier pulled again from the local directory, where the pull "
             "hands it the state it read",
        path="src/everystep/recovery.py",
        before="    if pulled is not None and pulled.state is not None and not shards and _is_pulled(manifest, pulled):",
        after="    if False:",
        tests=("tests/test_s3_tier.py::test_a_job_whose_machine_is_lost_resumes_on_a_new_one_from_the_remote_bitwise",),
    ),
    Mutation(
        name="pull-source-lost",
        what="a state recovered from what the remote tier pulled is reported as read from the disk",
        path="src/everystep/recovery.py",
        before='source="remote" if _is_pulled(manifest, pulled) else "disk"',
        after='source="disk"',
        tests=("tests/test_s3_tier.py::test_a_job_whose_machine_is_lost_resumes_on_a_new_one_from_the_remote_bitwise",),
    ),
    Mutation(
        name="peers-oldest",
        what="recovery from peers' memory takes the oldest step every rank can put together",
        path="src/everystep/peers/plan.py",
        before="if s > newer_than}, reverse=True)",
        after="if s > newer_than}, reverse=False)",
        tests=("tests/test_peers.py::test_the_ranks_take_the_newest_step_every_ranks_state_can_be_put_together_at",),
    ),
    Mutation(
        name="persist-at-close",
        what="checkfreq and async persist only the final checkpoint, at close",
        path="src/everystep/strategies/checkfreq.py",
        before="        if not self._due(step, final):\n            return\n        self._wait_snapshot()",
        after="        if not final:\n            return\n        self._wait_snapshot()",
        tests=("tests/test_strategies.py::test_killed_runs_recover_the_uninterrupted_runs_state[async]",
               "tests/test_strategies.py::test_killed_runs_recover_the_uninterrupted_runs_state[checkfreq]"),
    ),
    Mutation(
        name="memory-tier-unread",
        what="recovery never takes the memory tier's slot: a killed process restarts from the directory",
        path="src/everystep/strategies/memory_tier.py",
        before="        self._chosen = next(iter(self.held.candidates(every=False, finish=self._finish).values()), None)",
        after="        self._chosen = None",
        tests=cases("tests/test_memory_tier.py::test_a_killed_training_process_recovers_from_memory_losing_at_most_one_step",
                    "full_sync", "checkfreq", "async", "checkflow", "gockpt", "gockpt_o", "gockpt:device"),
    ),
    Mutation(
        name="slot-views-kept",
        what="a restore hands the optimizer the borrowed views of a region's slot it cannot load into tensors of "
             "the optimizer's own: the optimizer keeps them",
        path="src/everystep/state.py",
        before="                    changed[name] = t.clone(memory_format=torch.contiguous_format)\n",
        after="                    pass\n",
        tests=cases("tests/test_state.py::test_a_stored_view_goes_into_the_optimizers_own_tensor_and_is_never_kept",
                    "adamw", "in_backward"),
    ),
    Mutation(
        name="model-unsaved",
        what="no copy of the model is kept to put back, even where its load can fail (a load hook)",
        path="src/everystep/state.py",
        before="        before = self._saved(model=not plain)",
        after="        before = self._saved(model=False)",
        tests=cases("tests/test_state.py::test_a_load_that_fails_part_way_puts_every_live_object_back_as_it_was",
                    "adamw-model-tensors", "in_backward-model-tensors", "adamw-model-views", "in_backward-model-views"),
    ),
    Mutation(
        name="checksum-ignored",
        what="a reader that ignores checksums: an object whose bytes changed is loaded",
        path="src/everystep/storage/base.py",
        before='    if f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}" != expected:',
        after="    if False:",
        tests=cases("tests/test_strategies.py::test_a_corrupt_newest_checkpoint_is_skipped_for_the_one_before_it",
                    "async", "checkflow", "checkfreq", "full_sync", "gockpt", "gockpt_o", "lowdiff", "lowdiff_plus",
                    "naive_diff")  # (lightcheck's region has checks of its own)
        + ("tests/test_storage.py::test_flipped_byte_and_truncation_are_detected",
           "tests/test_storage.py::test_every_store_detects_a_flipped_byte_in_an_object[catalog]"),
    ),
    Mutation(
        name="manifest-first",
        what="a commit that writes the manifest before its objects",
        path="src/everystep/storage/formats/sharded.py",
        before="            info = write_part(catalog, kind, step, chunks, catalog.ranks)\n",
        after=(
            "            from .base import checksum\n"
            "            chunks = [bytes(c) for c in chunks]\n"
            "            early = ObjectInfo(name=object_name(kind, step, catalog.ranks), nbytes=sum(map(len, chunks)),\n"
            "                               checksum=checksum(b''.join(chunks)))\n"
            "            catalog.commit(Manifest(kind=kind, step=step, objects={'tensors': early},\n"
            "                                    meta={**meta, **rank_meta}, requires=requires))\n"
            "            info = write_part(catalog, kind, step, chunks, catalog.ranks)\n"
        ),
        tests=("tests/test_storage.py::test_a_full_checkpoint_killed_in_the_middle_of_its_write_commits_nothing",
               "tests/test_cli.py::test_crash_inside_a_write_leaves_the_previous_checkpoint"),
    ),
    Mutation(
        name="one-host-commits",
        what="under node-local disks only rank 0's host records each commit",
        path="src/everystep/storage/formats/sharded.py",
        before="    if catalog.leads:  # (every host's first rank",
        after="    if catalog.ranks.rank == 0:  # (every host's first rank",
        tests=("tests/test_node_local.py::test_hosts_restarted_in_place_resume_from_their_own_disks_bitwise",),
    ),
    Mutation(
        name="read-own-disk-only",
        what="under node-local disks each rank reads a checkpoint from its own host's disk alone",
        path="src/everystep/storage/full.py",
        before="    if directory.catalog.hosts is None:\n        return read_state(",
        after="    if True:\n        return read_state(",
        tests=("tests/test_node_local.py::test_hosts_restarted_in_place_resume_from_their_own_disks_bitwise",),
    ),
    Mutation(
        name="replaced-host-from-zero",
        what="a replaced host that nothing can supply starts the job from step 0, not refused",
        path="src/everystep/storage/hosts.py",
        before="    if having:\n",
        after="    if False:\n",
        tests=("tests/test_node_local.py::test_a_replaced_host_with_neither_peers_nor_remote_is_refused_in_one_message",),
    ),
    Mutation(
        name="arrival-unchecked",
        what="under node-local disks a part another host sends is taken without checking its size and checksum",
        path="src/everystep/storage/hosts.py",
        before='                check_bytes(infos[name], got, where, what=f"object {where}, on arrival,")\n',
        after="",
        tests=("tests/test_node_local.py::test_a_part_changed_on_its_way_between_hosts_is_refused_and_the_step_before_"
               "restored",),
    ),
    Mutation(
        name="part-hashed-early",
        what="LightCheck on CUDA hashes a part of its slot once the copy of its last entry in the layout is in, "
             "not the latest in copy order (the small tensors the layout puts last)",
        path="src/everystep/strategies/lightcheck_copy.py",
        before="            last = max(last, at[e.key])\n",
        after="            last = at[e.key]\n",
        tests=("tests/test_lightcheck.py::test_the_slot_is_hashed_in_parts_each_after_every_copy_it_needs",),
    ),
    Mutation(
        name="dcp-any-file",
        what="DCP reads whatever file its metadata names, from disk, unverified",
        path="src/everystep/storage/formats/dcp.py",
        before="            if mode != \"rb\" or path.parent != self._directory or path.name not in self.files:\n"
               "                raise CorruptCheckpointError(f\"the DCP metadata of {self._directory.name} names {path}, "
               "which is not \"\n                                             \"one of the checkpoint's files\")\n"
               "            data = self.read(path.name)\n",
        after="            data = bytearray(path.read_bytes())\n",
        tests=("tests/test_trust.py::test_a_dcp_metadata_that_names_a_file_outside_its_checkpoint_is_refused_and_"
               "recovery_falls_back", "tests/test_trust.py::test_a_dcp_checkpoint_is_read_once_and_dcp_reads_only_"
               "verified_bytes"),
    ),
    Mutation(
        name="optimizer-in-place-early",
        what="a restore writes the stored optimizer state into the live optimizer's tensors before the loads "
             "that may still fail, so putting the live objects back finds them changed",
        path="src/everystep/state.py",
        before="                    changed[name] = like\n",
        after="                    changed[name] = like.copy_(t)\n",
        tests=cases("tests/test_state.py::test_a_load_that_fails_part_way_puts_every_live_object_back_as_it_was",
                    "adamw-data-views", "adamw-model-views", "in_backward-data-views", "in_backward-model-views"),
    ),
    Mutation(
        name="optimizer-onto-device-new",
        what="a restore hands an optimizer whose state lies on a device the stored host state to load, which "
             "puts new tensors there in place of those it held",
        path="src/everystep/state.py",
        before="                        and (view and like.device == t.device or like.device.type != \"cpu\" and "
               "t.device.type == \"cpu\"):\n",
        after="                        and view and like.device == t.device:\n",
        tests=("tests/test_state.py::test_host_state_goes_into_the_tensors_a_live_optimizer_holds_on_another_device",),
    ),
    Mutation(
        name="lent-pages-unsettled",
        what="a writer that lent a slot's tensors writes a slot again while the lent pages may still be the "
             "file's, so the new checkpoint shows through the live state",
        path="src/everystep/storage/region/slots.py",
        before="        self.lending.settle()  # (no page lent out of a slot may still be the file's)\n",
        after="",
        tests=cases("tests/test_region.py::test_a_tensor_lent_out_of_a_slot_keeps_its_bytes_when_the_writer_"
                    "writes_that_slot_again", "by the next begin"),
    ),
    Mutation(
        name="state-not-lent",
        what="a restore from a region copies a fresh optimizer's state out of the slot, where it could lend it",
        path="src/everystep/strategies/region_tier.py",
        before="    lend = None if len(live) else lambda key: live.fate(key) is LoadFate.KEPT\n",
        after="    lend = None\n",
        tests=("tests/test_lightcheck.py::test_a_fresh_optimizer_keeps_the_state_lent_out_of_the_slot_and_trains_on_bitwise",),
    ),
    Mutation(
        name="lent-mapping-locks",
        what="the mapping a slot is read through keeps the writer's locked descriptor, so the tensors lent out of "
             "it keep the region locked after its writer closed",
        path="src/everystep/storage/region/slots.py",
        before="        fd = reopened(self._fd, str(self.path))\n",
        after="        fd = os.dup(self._fd)\n",
        tests=cases("tests/test_region.py::test_a_tensor_lent_out_of_a_slot_keeps_its_bytes_when_the_writer_"
                    "writes_that_slot_again", "by close"),
    ),
)


def scratch_copy(dest: Path) -> None:
    """The checkout's tracked and untracked (not ignored) files, copied under ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def apply(scratch: Path, m: Mutation) -> str:
    """Put the bug in; the original text, to put back."""
    path = scratch / m.path
    text = path.read_text()
    found = text.count(m.before)
    if found != 1:
        raise SystemExit(f"mutation {m.name}: {m.path} holds its text {found} times, not once — update tools/mutations.py")
    path.write_text(text.replace(m.before, m.after))
    return text


def outcomes(report: Path) -> dict[str, str]:
    """Each test's outcome in a JUnit report: passed, failed, error or skipped."""
    out: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        node = f"{file}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[node] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                     else "skipped" if "skipped" in kinds else "passed")
    return out


def run_tests(scratch: Path, tests: tuple[str, ...], workers: int, report: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(scratch / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(report),
           "-o", "junit_family=xunit1", "-m", "not long", *tests]
    if workers > 1:
        cmd += ["-n", str(workers), "--dist", "loadgroup"]
    subprocess.run(cmd, cwd=scratch, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return outcomes(report) if report.exists() else {}


def check_isolation(scratch: Path) -> None:
    """The scratch copy's package, not the checkout's, is the one imported."""
    env = {**os.environ, "PYTHONPATH": str(scratch / "src")}
    where = subprocess.run([sys.executable, "-c", "import everystep; print(everystep.__file__)"], env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(scratch.resolve()):
        raise SystemExit(f"the scratch copy's tests would import everystep from {where}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated names of the bugs to try (default: all)")
    parser.add_argument("--list", action="store_true", help="print the bugs and their tests, run nothing")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--json", type=Path, help="write the results there")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"--only: no bug named {', '.join(sorted(unknown))}; the bugs: {', '.join(m.name for m in MUTATIONS)}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n  " + "\n  ".join(m.tests))
        return 0
    results, survived = [], []
    with tempfile.TemporaryDirectory(prefix="everystep-mutations-") as tmp:
        scratch = Path(tmp) / "tree"
        scratch_copy(scratch)
        check_isolation(scratch)
        for i, m in enumerate(chosen, 1):
            t0 = time.monotonic()
            original = apply(scratch, m)
            try:
                got = run_tests(scratch, m.tests, args.workers, Path(tmp) / f"{m.name}.xml")
            finally:
                (scratch / m.path).write_text(original)
            passed = sorted(n for n, o in got.items() if o != "failed")
            caught = bool(got) and not passed
            results.append({"name": m.name, "what": m.what, "caught": caught, "seconds": round(time.monotonic() - t0, 1),
                            "failed": sorted(n for n, o in got.items() if o == "failed"),
                            "not_failed": {n: got[n] for n in passed}})
            print(f"[{i}/{len(chosen)}] {m.name}: {'caught' if caught else 'SURVIVED'} "
                  f"({len(got) - len(passed)} of {len(got)} tests failed, {time.monotonic() - t0:.0f} s) — {m.what}",
                  flush=True)
            for n in passed:
                print(f"    {got[n]}: {n}")
            if not caught:
                survived.append(m.name)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if survived:
        print(f"{len(survived)} of {len(chosen)} bugs survived: {', '.join(survived)}")
        return 1
    print(f"all {len(chosen)} bugs caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
