"""The newest recoverable point, for every strategy.

A point is one of: a replica in memory (a checkpoint agent's; its strategy asks for it, and under
several ranks the ranks agree on one with :func:`common_step`), or the newest full checkpoint that
verifies, plus the gap-free chain of verified differentials that starts at its step. A differential manifest names its ``base`` (the full checkpoint's step) and the steps
it covers (``first``..``last``, or its own step); its tensors hold what the strategy replays and,
under ``end/``, the state gradients cannot rebuild (see
:meth:`~everystep.state.TrainingComponents.end_state`). A differential that fails to verify ends
the chain there, with a warning; what comes after it is not used.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CorruptCheckpointError, NoValidCheckpointError, StateMismatchError
from .storage import (CheckpointDirectory, Manifest, Reader, elsewhere, gather_from_hosts, malformed, read_state,
                      read_state_together)
from .state import TrainingComponents
from .tree import unflatten
from .storage.formats import read_parts
from .storage.remote import Pulled

__all__ = ["Candidate", "Recovered", "load", "Link", "read_full", "read_state", "latest_full", "recover",
           "read_differential", "chain", "recover_chain", "common_step"]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A state a strategy found to recover, read and verified but not loaded: ``tree`` is S_step;
    ``source`` says where it came from. :func:`load` puts it into the live objects."""

    step: int
    tree: dict[str, Any]
    source: str
    manifest: Manifest | None
    seconds: float
    """To find, read and verify it."""
    replay: Callable[[], tuple[int, str]] | None = None
    """A differential chain's: once ``tree`` is loaded, it moves the live objects forward through the
    chain and returns the step reached and the source to report."""
    borrowed: frozenset[str] = frozenset()
    """The flat keys of optimizer state in ``tree`` that are views of memory the live objects must
    not keep (a region's slot): the load puts each into the optimizer's own tensor, or a copy
    (:meth:`~everystep.state.TrainingComponents.restore`)."""


@dataclass(frozen=True, kw_only=True)
class Recovered:
    """What a restore loaded into the live objects: S_step, from ``source``."""

    step: int
    source: str
    manifest: Manifest | None
    seconds: float


def load(candidate: Candidate, components: TrainingComponents) -> Recovered:
    """Load ``candidate`` into the live objects — checked first, put back as it was if a component
    refuses (:meth:`~everystep.state.TrainingComponents.restore`) — then replay what it chains, and
    report what was recovered. The one place a recovered state enters the live objects."""
    t0 = time.perf_counter()
    components.restore(candidate.tree, borrowed=candidate.borrowed)
    step, source = candidate.step, candidate.source
    if candidate.replay is not None:
        step, source = candidate.replay()
    return Recovered(step=step, source=source, manifest=candidate.manifest,
                     seconds=candidate.seconds + time.perf_counter() - t0)


Shards = Mapping[str, torch.Tensor] | None
"""A sharded job's live DTensors by key, whose tensors a checkpoint's are read as shards of
(:func:`~everystep.storage.formats.sharded.read_parts`); None: a replicated job's."""


def read_full(directory: CheckpointDirectory, manifest: Manifest, *, shards: Shards = None,
              pulled: Pulled | None = None) -> dict[str, Any]:
    """Read, verify and rebuild the state tree of a full checkpoint (``shards``: as :func:`read_state`).
    Under node-local disks every rank reads it at once, and all fail if one does
    (:func:`~everystep.storage.full.read_state_together`). The checkpoint a remote tier ``pulled`` at
    this restore is taken as it read it, where it read it as this job reads it (a replicated job's)."""
    if pulled is not None and pulled.state is not None and not shards and _is_pulled(manifest, pulled):
        return pulled.state[0]
    return read_state_together(directory, manifest, shards)[0]


def _is_pulled(manifest: Manifest, pulled: Pulled | None) -> bool:
    """Whether ``manifest`` is the checkpoint a remote tier pulled at this restore (a name says its
    kind, step and rank)."""
    return pulled is not None and pulled.manifest.name == manifest.name


def latest_full(directory: CheckpointDirectory, *, shards: Shards = None,
                pulled: Pulled | None = None) -> tuple[Manifest, dict[str, Any]] | None:
    """The newest full checkpoint that verifies, with its state (``shards``, ``pulled``: as
    :func:`read_full`); ``None`` when there is none.

    Each checkpoint that fails verification is skipped with a warning naming why; if every one
    fails, :class:`NoValidCheckpointError` lists the reasons.
    """
    for _ in range(_RELISTS):
        skipped: list[tuple[str, str]] = []
        found = _latest_listed(directory, skipped, shards, pulled)
        if found is _DISCARDED:
            continue  # warn only about the listing that is answered
        for warning, _ in skipped:
            warnings.warn(warning, stacklevel=3)
        if found is None and skipped:
            raise NoValidCheckpointError(f"no valid checkpoint in {directory.root}: " + "; ".join(r for _, r in skipped))
        return found  # type: ignore[return-value]
    raise NoValidCheckpointError(f"no checkpoint in {directory.root} stayed committed long enough to be read: the "
                                 f"process writing there discarded each one that was being read, {_RELISTS} times")


_RELISTS = 16
_DISCARDED = object()


def _latest_listed(directory: CheckpointDirectory, skipped: list[tuple[str, str]], shards: Shards,
                   pulled: Pulled | None) -> tuple[Manifest, dict[str, Any]] | None | object:
    """:func:`latest_full` over one listing of the manifests, each skipped one added to ``skipped``
    (its warning, its reason); ``_DISCARDED`` when a checkpoint was discarded by the directory's
    writer while it was read (list again: a newer one is there)."""
    records = directory.catalog.manifests()
    skipped.extend((f"skipping {r.name}: {r.error}", r.error) for r in records if r.error)
    for manifest in directory.fulls(records):
        try:
            return manifest, read_full(directory, manifest, shards=shards, pulled=pulled)
        except CorruptCheckpointError as e:
            if not directory.catalog.committed(manifest.name):
                return _DISCARDED
            away = elsewhere(manifest, directory.catalog) if directory.catalog.hosts is None else None
            why = f"{e} ({away[1]}: to read it whole here, copy every host's objects/ into one directory)" \
                if away is not None and away[0] else str(e)  # (one host's directory, read alone)
            skipped.append((f"skipping the checkpoint at step {manifest.step}: {why}", f"step {manifest.step}: {why}"))
    return None


def recover(directory: CheckpointDirectory, *, shards: Shards = None, pulled: Pulled | None = None) -> Candidate | None:
    """The newest full checkpoint in ``directory`` that verifies (``shards``, ``pulled``: as
    :func:`read_full`), or ``None`` for an empty one; its source ``remote`` where it is the one pulled."""
    t0 = time.perf_counter()
    found = latest_full(directory, shards=shards, pulled=pulled)
    if found is None:
        return None
    manifest, tree = found
    return Candidate(step=manifest.step, tree=tree, source="remote" if _is_pulled(manifest, pulled) else "disk",
                     manifest=manifest, seconds=time.perf_counter() - t0)


@dataclass(frozen=True)
class Link:
    """One verified differential of a chain: its manifest, its tensors, and its end state as a tree."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    end: dict[str, Any]

    @property
    def first(self) -> int:
        return _first(self.manifest)


def _first(manifest: Manifest) -> int:
    """The first step a differential covers."""
    return int(manifest.meta.get("first", manifest.step))


def read_differential(catalog: Reader, manifest: Manifest) -> Link:
    """Read and verify a differential; raises CorruptCheckpointError if it fails to verify."""
    tensors, meta = read_parts(catalog, manifest)
    with malformed(f"differential {manifest.name}"):
        end = unflatten(meta["end"], {k[len("end"):]: v for k, v in tensors.items() if k.startswith("end/")})
        if not isinstance(end, dict) or end.get("step") != manifest.step:
            raise ValueError(f"its end state is not that of step {manifest.step}")
    return Link(manifest, tensors, end)


def chain(catalog: Reader, full: Manifest, kind: str,
          check: Callable[[dict[str, Any]], None] | None = None) -> Iterator[Link]:
    """The differentials of ``kind`` whose base is ``full``, in order from the step after it, each
    read and verified as it is reached (``check``: its end state too, raising an EverystepError);
    ends at a gap or, with a warning, at one that fails."""
    links = {}
    for r in catalog.manifests():
        m = r.manifest
        if m is not None and m.kind == kind and m.meta.get("base") == full.step:
            first = m.meta.get("first", m.step)
            if type(first) is int and full.step < first <= m.step:  # else malformed: never reached
                links[first] = m
    step = full.step
    while (m := links.get(step + 1)) is not None:
        try:
            link = read_differential(catalog, m)
            if check is not None:
                check(link.end)
        except (CorruptCheckpointError, StateMismatchError) as e:
            warnings.warn(f"the differential chain from step {full.step} ends at step {step}: {e}", stacklevel=3)
            return
        yield link
        step = m.step


def recover_chain(directory: CheckpointDirectory, components: TrainingComponents, kind: str,
                  apply: Callable[[Iterator[Link]], None], source: Callable[[int, int], str],
                  pulled: Pulled | None = None) -> Candidate | None:
    """The newest verified full checkpoint (``pulled``: as :func:`read_full`), whose replay (once
    :func:`load` has loaded it into ``components``) has ``apply`` replay the chain of ``kind`` after it
    (it consumes the links it is given, in order), then loads the end state of the last link applied,
    and reports the step reached and ``source(full step, step reached)`` — ``remote`` for the pulled
    checkpoint with nothing replayed after it. ``None`` for an empty store."""
    t0 = time.perf_counter()
    found = latest_full(directory, pulled=pulled)
    if found is None:
        return None
    full, tree = found
    from_remote = _is_pulled(full, pulled)

    def reported(step: int) -> str:
        return "remote" if from_remote and step == full.step else source(full.step, step)

    reader: Reader | None = directory.catalog
    if directory.catalog.hosts is not None:  # every rank takes the chain's parts from the hosts at once
        links = [r.manifest for r in directory.catalog.manifests()
                 if r.manifest is not None and r.manifest.kind == kind and r.manifest.meta.get("base") == full.step]
        try:
            reader = gather_from_hosts(directory.catalog, links)
        except CorruptCheckpointError as e:
            warnings.warn(f"the differential chain from step {full.step} is not read: {e}", stacklevel=2)
            reader = None

    def replay() -> tuple[int, str]:
        applied: list[Link] = []

        def tracked() -> Iterator[Link]:
            for link in chain(reader, full, kind, components.check_end_state) if reader is not None else ():
                yield link
                applied.append(link)  # reached only once ``apply`` asks for the next link, or at the end

        apply(tracked())
        if applied:
            components.apply_end_state(applied[-1].end)
        step = applied[-1].manifest.step if applied else full.step
        return step, reported(step)

    return Candidate(step=full.step, tree=tree, source=reported(full.step), manifest=full,
                     seconds=time.perf_counter() - t0, replay=replay)


def common_step(reachable: list[list[int] | None], on_disk: int) -> int | None:
    """Several ranks, each with a replica in memory: the newest step every rank's replica can serve
    (each lists the steps it can reach; None: no replica), provided storage holds nothing newer;
    else None (every rank recovers from storage)."""
    if not reachable or any(r is None for r in reachable):
        return None
    best = max(set.intersection(*(set(r) for r in reachable if r is not None)), default=None)
    return best if best is not None and best >= on_disk else None
