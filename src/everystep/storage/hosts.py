"""Node-local checkpoint directories: each host keeps its checkpoints on its own disk, at the same path.

Under several ranks every rank opens the path it is given. Whether they see one directory (a
shared filesystem) or several (each host's own disk) is found out at open (:func:`probe`): each
rank writes an empty file named by a token rank 0 draws, and looks for every other rank's by name;
the ranks that see each other's files share a directory — a *host* here. Where every rank sees
every file the directory is shared and nothing below applies.

Under node-local directories:

- **Writing** is as before: each rank writes its part of a checkpoint into its own directory, and
  the ranks exchange what they wrote; then each host's first rank (its *leader*) commits the same
  manifest, naming every rank's part, in its own directory, so that every host records every
  commit. The leader takes the directory's lock, checks its marker (the hosts' markers must agree:
  a new host's leader copies what the others' say), retains and collects garbage there.
- **Restoring** (:func:`agree_across_hosts`, collective): the ranks list what each host's directory holds and
  keep only the checkpoints that every host committed and whose parts some host holds; the rest
  are hidden from this run (a crash between the parts and the manifest leaves the newest on some
  hosts only), and a writer's leaders discard them once training starts
  (:func:`discard_hidden`). A checkpoint is read by every rank at once (:func:`gather_from_hosts`;
  :func:`~everystep.storage.full.read_state_together`): each part
  a rank reads but its host lacks is sent by a rank of the host that holds it (read and verified
  there, verified again on arrival), over the job's own gloo group. Every rank learns whether every
  rank read it (:func:`read_together`), so that all take the same checkpoint, or all skip it.
- A host whose directory holds none of the checkpoints the others hold (a replaced machine, an
  empty disk) takes its state from peers' memory (``peers=True``) or the remote tier (``remote=``);
  where neither has it, the job refuses to start (:func:`check_restored_across_hosts`), naming what is missing.

Only full checkpoints in everystep's own format (``safetensors``) are written so: DCP's metadata is
written by one rank, which one host alone would hold.

A job of several ranks that opens its directories for reading writes nothing, not even a probe:
the ranks whose directories list the same checkpoints and objects read as one host
(:func:`readers_hosts`), and read as above.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..distributed import Ranks
from ..errors import CheckpointDirectoryError, ConfigError, CorruptCheckpointError, NoValidCheckpointError, StateMismatchError
from .base import Manifest, Reader, check_bytes, checksum
from .catalog import MANIFESTS, Catalog, Supplemented

if TYPE_CHECKING:
    import torch

__all__ = ["PROBE", "Hosts", "probe", "hosts_of", "listing", "readers_hosts", "agree_markers", "agree_across_hosts",
           "gather_from_hosts", "read_together", "check_restored_across_hosts", "discard_hidden", "elsewhere"]

Hosts = tuple[tuple[int, ...], ...]
"""The ranks of each host (of each directory), each in order, the host of rank 0 first."""
PROBE = ".everystep-probe-"
"""The start of the name of a rank's probe file (:func:`probe`), removed before open returns."""


def probe(path: Path, ranks: Ranks, *, create: bool) -> Hosts | None:
    """Collective: which ranks see one directory at ``path`` (created first, with ``create``); None
    when every rank sees the same. Each rank writes a probe file named by a token rank 0 draws, and
    looks up every rank's by name (a lookup of a name never seen before is not answered from a
    cache of the folder's listing, as a shared filesystem's client may answer a listing)."""
    token = ranks.broadcast("control", secrets.token_hex(8))
    mine = path / f"{PROBE}{token}-{ranks.rank}"
    error: BaseException | None = None
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        elif not path.is_dir():
            raise CheckpointDirectoryError(f"no everystep checkpoint directory at {path}")
        os.close(os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except CheckpointDirectoryError as e:
        error = e
    except OSError as e:
        error = CheckpointDirectoryError(f"cannot write in the checkpoint directory {path}: {e.strerror or e}")
    ranks.exchange("control", {}, error, f"opening {path}")
    seen = [r for r in range(ranks.world) if os.path.lexists(path / f"{PROBE}{token}-{r}")]
    seen_by = ranks.all_gather("control", seen)
    mine.unlink(missing_ok=True)
    ranks.barrier("control")  # (no rank looks at the folder while another's probe is there)
    return hosts_of(seen_by, path)


def hosts_of(seen_by: list[list[int]], path: Path | str) -> Hosts | None:
    """The hosts, from the ranks whose probe each rank saw (None: every rank saw every one);
    :class:`CheckpointDirectoryError` where they do not fall into hosts that see only their own."""
    world = len(seen_by)
    if all(len(seen) == world for seen in seen_by):
        return None
    for rank, seen in enumerate(seen_by):
        odd = next((other for other in seen if seen_by[other] != seen), None)
        if rank not in seen or odd is not None:
            raise CheckpointDirectoryError(
                f"the ranks see {path} inconsistently: rank {rank} sees the files of ranks {seen}"
                + (f", rank {odd} those of {seen_by[odd]}" if odd is not None else "")
                + " — it must be one directory that every rank sees, or each host's own")
    return tuple(sorted({tuple(seen) for seen in seen_by}))


def listing(catalog: Catalog) -> str:
    """What ``catalog``'s directory lists, as one digest: its manifests' and its objects' names."""
    names = [sorted(catalog.store.list(MANIFESTS)), catalog.object_names()]
    return checksum(json.dumps(names).encode())


def readers_hosts(listings: list[str]) -> Hosts | None:
    """For a reader of several ranks, which writes nothing (no probe): the ranks whose directories
    list the same manifests and objects (``listings``, each rank's :func:`listing`) read as one
    host; None where every rank's lists the same. Each host's own disk holds its own ranks' parts,
    so the hosts' listings differ; ranks that list the same read alike, whether or not they share
    one directory (a directory listed while its writer commits may be taken for several: each rank
    then reads what its listing holds and is sent the rest, as under node-local disks)."""
    if len(set(listings)) == 1:
        return None
    return tuple(sorted(tuple(r for r, seen in enumerate(listings) if seen == digest) for digest in set(listings)))


def agree_markers(path: Path, hosts: Hosts, ranks: Ranks, marker: dict[str, Any] | None, error: BaseException | None,
                  wanted: str | None) -> str:
    """Collective, at the open of node-local directories: the markers the hosts' directories hold
    (``marker``: this host's leader's, None where its directory is new; ``error``: why it could not be
    read) must say the same job; returns the format of full checkpoints for a new one (``wanted``,
    the one asked for, else the others'), which must be everystep's own."""
    reports = ranks.exchange("control", {"marker": marker}, error, f"opening {path}")
    found = [(g, reports[g[0]]["marker"]) for g in hosts if reports[g[0]]["marker"] is not None]
    for key in ("strategy", "full_format", "world_size"):
        if len({str(m.get(key)) for _, m in found}) > 1:
            raise CheckpointDirectoryError(f"the hosts' directories {path} hold different jobs' checkpoints (their "
                                           f"{key}: " + "; ".join(f"ranks {list(g)}: {m.get(key)!r}" for g, m in found)
                                           + "): empty the one that does not belong")
    wanted = wanted or (str(found[0][1].get("full_format") or "safetensors") if found else "safetensors")
    if wanted == "dcp":
        raise ConfigError(f"{path} is each host's own directory (node-local disks), where checkpoints are written in "
                          "everystep's own format: DCP's metadata is written by one rank, on one host only; use "
                          "full_format='safetensors' (or a directory every host shares)")
    return wanted


def agree_across_hosts(catalog: Catalog) -> dict[str, Any]:
    """Collective, under node-local directories: hide from each rank's listing the checkpoints that
    not every host committed (the same manifest), or whose parts no host holds. Returns what the hosts hold: for each
    host (its ranks), the steps of the full checkpoints committed there."""
    assert catalog.hosts is not None
    catalog.hide(set())
    held: dict[str, Any] | None = None
    if catalog.leads:
        objects = set(catalog.object_names())
        held = {r.name: {"full": r.manifest.kind == "full", "step": r.manifest.step, "digest": checksum(r.manifest.to_bytes()),
                         "objects": sorted(o.name for o in r.manifest.objects.values()),
                         "held": sorted(o.name for o in r.manifest.objects.values() if o.name in objects)}
                for r in catalog.manifests() if r.manifest is not None}
    views = catalog.ranks.all_gather("control", held)
    hosts = [views[g[0]] for g in catalog.hosts]
    common = {name for name in set.intersection(*(set(h) for h in hosts))
              if len({h[name]["digest"] for h in hosts}) == 1}  # (the same manifest on every host)
    holding = set().union(*(set(v["held"]) for h in hosts for v in h.values()))
    usable = {name for name in common if set(hosts[0][name]["objects"]) <= holding}
    catalog.hide(set(views[catalog.group[0]]) - usable)
    return {"hosts": [{"ranks": list(g), "fulls": sorted(v["step"] for v in h.values() if v["full"])}
                      for g, h in zip(catalog.hosts, hosts)]}


def gather_from_hosts(catalog: Catalog, manifests: list[Manifest], shards: Mapping[str, "torch.Tensor"] | None = None) -> Reader:
    """Collective, under node-local directories: a reader of ``manifests`` for this rank — its own
    host's objects from its directory, the others it reads (:func:`~everystep.storage.formats.sharded.parts_read`)
    sent by a rank of the host that holds each. Every rank calls it with the same manifests.
    :class:`CorruptCheckpointError` on every rank where a part is on no host's disk, or one sent
    fails its checksum at either end."""
    from .formats.sharded import parts_read  # (it imports torch, which a reader of one host's directory needs not)

    ranks = catalog.ranks
    infos = {info.name: info for m in manifests for info in m.objects.values()}
    error: BaseException | None = None
    wanted: list[str] = []
    try:
        wanted = sorted({m.objects[key].name for m in manifests
                         for key in parts_read(m, ranks.rank, ranks.world, shards) if key in m.objects})
    except CorruptCheckpointError as e:
        error = e
    held = {name for name in infos if catalog.has_object(name)}
    views = ranks.all_gather("control", {"wanted": [n for n in wanted if n not in held], "held": sorted(held)})
    read_together(catalog, error)
    plan = []
    for rank, view in enumerate(views):
        for name in view["wanted"]:
            holders = [r for r, v in enumerate(views) if name in v["held"]]
            if not holders:
                raise CorruptCheckpointError(f"checkpoint {manifests[0].name}: its object {name} is on no host's disk "
                                             f"(rank {rank} reads it)")
            plan.append((name, holders[0], rank))
    received: dict[str, tuple[Any, bytearray]] = {}
    for name, source, to in plan:
        if ranks.rank == source:
            try:
                data: bytearray | None = catalog.read_object(infos[name])
            except (CorruptCheckpointError, OSError) as e:  # (the receiver learns it, and every rank below)
                data, error = None, CorruptCheckpointError(str(e))
            ranks.send_bytes("control", data, to)
        elif ranks.rank == to:
            got = ranks.recv_bytes("control", source)
            where = f"{name} from rank {source}"
            try:
                if got is None:
                    raise CorruptCheckpointError(f"object {where}: it does not verify there")
                check_bytes(infos[name], got, where, what=f"object {where}, on arrival,")
                received[name] = (infos[name], got)
            except CorruptCheckpointError as e:
                error = e
    read_together(catalog, error)
    return Supplemented(catalog, received) if received else catalog


def read_together(catalog: Catalog, error: BaseException | None) -> None:
    """Collective, under node-local directories: raise :class:`CorruptCheckpointError` on every rank
    where a checkpoint failed to read on any (``error``: this rank's), so that every rank skips it."""
    reports = catalog.ranks.all_gather("control", None if error is None else str(error))
    failed = [(r, why) for r, why in enumerate(reports) if why is not None]
    if error is not None:
        raise error
    if failed:
        raise CorruptCheckpointError("; ".join(f"rank {r}: {why}" for r, why in failed))


def check_restored_across_hosts(catalog: Catalog, step: int, held: dict[str, Any] | None) -> None:
    """Collective after a restore under several ranks: refuse to go on where the ranks restored
    different steps, or where none was restored while some host's directory holds a full checkpoint
    (``held``: what :func:`agree_across_hosts` found) — never some ranks from step 0 and others from step N."""
    steps = catalog.ranks.all_gather("control", step)
    if len(set(steps)) > 1:
        raise StateMismatchError("the ranks restored different steps (" + ", ".join(f"rank {r}: {s}" for r, s in
                                                                                     enumerate(steps)) + "); nothing "
                                 "was trained: the directories disagree — run everystep verify on each host's")
    if step or held is None:
        return
    having = [h for h in held["hosts"] if h["fulls"]]
    if having:
        lacking = [h["ranks"] for h in held["hosts"] if h not in having]
        newest = max(max(h["fulls"]) for h in having)
        raise NoValidCheckpointError(
            f"no step to restore that every host can load: the directories {catalog.root} of ranks "
            f"{', '.join(map(str, (h['ranks'] for h in having)))} hold full checkpoints (newest: step {newest}), "
            + (f"those of ranks {', '.join(map(str, lacking))} none of them" if lacking else "but no one step on every host")
            + " — a replaced host's parts come from peers' memory (peers=True) or a remote tier (remote=); nothing was "
            "loaded or changed: give one of those, or start every host from an empty directory")


def discard_hidden(catalog: Catalog) -> list[str]:
    """A writer's start under node-local directories: each leader discards the checkpoints
    :func:`agree_across_hosts` hid (not every host holds them, so the job cannot restore them), and says which."""
    hidden = sorted(catalog.hidden)
    if not hidden or not catalog.leads or catalog.access != "write":
        return []
    for name in hidden:
        catalog.discard(name)
    return hidden


def elsewhere(manifest: Manifest, catalog: Catalog) -> tuple[list[str], str] | None:
    """For ``inspect`` and ``verify``, of a checkpoint written under node-local directories (None for
    another): its objects that lie on other hosts' disks — those of the hosts none of whose parts
    this directory holds — and a line that says so. Where it holds none of them, none is taken for
    another host's: each is missing."""
    hosts = manifest.meta.get("hosts")
    if not isinstance(hosts, list) or not all(isinstance(g, list) for g in hosts):
        return None
    present = {key for key, info in manifest.objects.items() if catalog.has_object(info.name)}
    here = [g for g in hosts if any(f"tensors-r{r}" in present for r in g)]
    away = sorted(manifest.objects[f"tensors-r{r}"].name for g in hosts if g not in here for r in g
                  if f"tensors-r{r}" in manifest.objects)
    ranks = sorted(r for g in here for r in g)
    if not here:
        return [], f"node-local ({len(hosts)} hosts): no part of it is here"
    return away, (f"node-local ({len(hosts)} hosts): the parts of ranks {ranks} are here, the other {len(away)} on "
                  "the other hosts' disks, not read here")
