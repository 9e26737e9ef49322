"""Where a checkpoint directory's region lies, and opening it for its writer or a reader."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import CheckpointDirectoryError, ConfigError, EverystepError
from ...files import read_regular, untrusted_folder
from .slots import Region, UnreadableRegionError, UntrustedRegionError

if TYPE_CHECKING:
    from ..directory import CheckpointDirectory

__all__ = ["region_path", "open_region", "memory_path", "memory_place", "memory_record", "record_memory", "named_region",
           "readable_region", "region_places", "memory_folders", "spare_memory_folder", "own_memory_folder",
           "MEMORY_ROOT"]

MEMORY_ROOT = Path("/dev/shm")
"""Where a full-state strategy's memory tier lies unless ``region=`` says otherwise."""


def region_path(directory: Path, region: str | None, rank: int, world: int) -> Path:
    """Where rank ``rank``'s region lies, for a checkpoint directory and a ``region`` option."""
    if region is None:
        return directory / "region" / f"rank-{rank}.bin"
    if "{rank}" in region:
        return Path(region.replace("{rank}", str(rank)))
    return Path(region) if world == 1 else Path(f"{region}.rank-{rank}")


def memory_path(directory: Path, region: str | None, rank: int, world: int) -> Path:
    """Where rank ``rank``'s memory tier (``memory=True``) lies, for a checkpoint directory and a
    ``region`` option: by default in :data:`MEMORY_ROOT`, in a folder of the user's and a name drawn
    from the directory's path."""
    if region is not None:
        return region_path(directory, region, rank, world)
    name = hashlib.sha256(os.path.realpath(directory).encode()).hexdigest()[:16]
    return MEMORY_ROOT / f"everystep-{os.geteuid()}" / name / f"rank-{rank}.bin"


def memory_record(root: Path, rank: int) -> Path:
    """The file in a directory that records where its rank's memory tier lies (:func:`memory_place`)."""
    return root / f"memory-r{rank}.json"


def memory_place(root: Path, rank: int, world: int) -> tuple[Path, str | None]:
    """Where rank ``rank``'s memory tier lies by default: where the directory's record says
    (:func:`memory_record`) when it was made for this folder — the same one, by device and inode, so
    moved or renamed since, which changes the place :func:`memory_path` draws from the path — and it
    lies in the memory tiers' folder; else :func:`memory_path`'s place. And why a record was passed
    over (a copy of the directory holds its original's record), or None."""
    default = memory_path(root, None, rank, world)
    try:
        record = json.loads(read_regular(memory_record(root, rank), limit=4096))
        path, folder = Path(record["path"]), tuple(record["folder"])
    except FileNotFoundError:
        return default, None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return default, f"its record of the memory tier cannot be read ({e}): not used"
    st = os.stat(root)
    if folder != (st.st_dev, st.st_ino):
        return default, f"it records the memory tier {path}, made for a folder elsewhere (a copy of it?): not used"
    if named_region(str(path), root) is not None:
        return default, f"it records the memory tier {path}, outside the memory tiers' folder: not used"
    return path, None


def record_memory(directory: "CheckpointDirectory", rank: int, path: Path) -> None:
    """Record (its writer) where ``directory``'s memory tier of ``rank`` lies, for this very folder."""
    st = os.stat(directory.root)
    body = json.dumps({"path": str(path), "folder": [st.st_dev, st.st_ino]}).encode()
    try:
        if read_regular(memory_record(directory.root, rank), limit=4096) == body:
            return
    except (OSError, ValueError):
        pass
    directory.put_file(memory_record(directory.root, rank).name, body)


def named_region(option: str | None, root: Path) -> str | None:
    """Of a ``region=`` that a directory's marker names, what a reader may open: the option where the
    folder it names lies in the directory (``root``) or in the user's folder of memory tiers, else
    why not (None: the default place, always). A reader opens nothing a file it did not write points
    it to elsewhere."""
    if option is None:
        return None
    folder = Path(os.path.realpath(Path(option.replace("{rank}", "0")).parent))
    mine = [Path(os.path.realpath(root)), *memory_folders()]
    if any(folder == place or place in folder.parents for place in mine):
        return None
    return (f"its marker names the region {option!r}, outside the directory and the memory tiers' folder "
            f"{mine[1]}: not opened by a reader")


def memory_folders() -> list[Path]:
    """The user's folders of memory tiers: ``everystep-UID`` in :data:`MEMORY_ROOT`, then those made
    in its stead where another user holds that name (``everystep-UID-*``, :func:`spare_memory_folder`),
    each this user's own, mode 0700."""
    uid = os.geteuid()
    found = [Path(os.path.realpath(MEMORY_ROOT / f"everystep-{uid}"))]
    try:
        names = sorted(os.listdir(MEMORY_ROOT))
    except OSError:
        return found
    for name in names:
        if name.startswith(f"everystep-{uid}-"):
            try:
                st = os.lstat(MEMORY_ROOT / name)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
                found.append(MEMORY_ROOT / name)
    return found


def spare_memory_folder() -> Path:
    """A folder of memory tiers of a name no one can know in advance (``everystep-UID-<random>``, mode
    0700), for a user whose ``everystep-UID`` another user made: the directory's record of the tier
    (:func:`record_memory`) says where it lies."""
    return Path(tempfile.mkdtemp(prefix=f"everystep-{os.geteuid()}-", dir=MEMORY_ROOT))


def readable_region(named: object, root: Path, given: str | None) -> str | None:
    """The ``region=`` a reader opens: ``given`` (the user's word), else ``named`` (what a run
    record says) where :func:`named_region` lets a reader open it, else None (the default places),
    with a warning saying to give ``--region``."""
    if given is not None:
        return given
    refused = named_region(named, root) if isinstance(named, (str, type(None))) \
        else f"its marker names a region that is not a path ({named!r})"
    if refused is not None:
        warnings.warn(f"{root}: {refused}; give --region to read it", stacklevel=4)
        return None
    return named  # type: ignore[return-value]


def region_places(directory: "CheckpointDirectory", region: str | None = None) -> list[tuple[int, str | None]]:
    """Where a reader looks for ``directory``'s regions, as (rank, ``region=`` option) pairs: where
    ``region`` says, else where its run record says if that lies in the directory or the memory
    tiers' folder (:func:`named_region`: a reader opens nothing else a
    stored file names, and warns), else the default places — lightcheck's in the directory, and the
    memory tier's (:func:`memory_place`)."""
    run = directory.marker.get("run")
    options = run.get("options") if isinstance(run, dict) else None
    option = readable_region(options.get("region") if isinstance(options, dict) else None, directory.root, region)
    world = int(directory.marker.get("world_size", 1))
    return [(rank, place) for rank in range(world)
            for place in ([option] if option is not None else [None, str(memory_place(directory.root, rank, world)[0])])]


def _open_claimed(directory: "CheckpointDirectory", path: Path, token: str, flush: bool | None) -> Region:
    """The writer's region at ``path``, made for ``token`` if absent; one whose header does not parse
    is made anew only where the directory's full checkpoints replace what it may hold."""
    try:
        return Region.open(path, ranks=directory.ranks, flush=flush, owner=token)
    except UnreadableRegionError as e:
        if not directory.fulls():
            raise CheckpointDirectoryError(
                f"{e}; nothing was changed, since it may hold checkpoints that no full checkpoint in "
                f"{directory.root} replaces: to start over, delete {path}") from None
        warnings.warn(f"{e}: training resumes from the full checkpoints of {directory.root}, and the region is "
                      "made anew", stacklevel=4)
        return Region.open(path, ranks=directory.ranks, flush=flush, owner=token, remake=True)


CLAIM_LIMIT = 64
"""The most bytes a region's claim (``region-r<rank>.owner``, a 32-character token) is read of."""


def _claimed(claim: Path) -> str | None:
    """The token of the directory's claim of its region (None: no claim); a :class:`ValueError` for
    a file that is not a regular file of a claim's size (:func:`~everystep.files.read_regular`)."""
    try:
        return read_regular(claim, limit=CLAIM_LIMIT).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return None


def open_region(directory: "CheckpointDirectory", region: str | None, *, flush: bool | None = None,
                rank: int | None = None, read: bool = False) -> Region | None:
    """This rank's region of ``directory``: made if absent (a writer), or ``None`` for a reader
    (``directory`` opened for reading, or ``read``) where there is none. A region records, when made,
    the token that its directory keeps in ``region-r<rank>.owner``; a region that another directory
    made (a ``region=`` path given to two runs in turn) is refused to a writer, nothing changed, and
    skipped with a warning by a reader. ``rank``: a reader's choice of rank (default: this process's)."""
    if directory.remote:
        return None  # (a remote tier holds full checkpoints only; regions are the machine's)
    ranks = directory.ranks
    rank = ranks.rank if rank is None else rank
    read = read or directory.access == "read"
    world = ranks.world if not read else int(directory.marker.get("world_size", ranks.world))
    path = region_path(directory.root, region, rank, world)
    claim = directory.root / f"region-r{rank}.owner"
    try:
        token = _claimed(claim)
    except ValueError as e:  # (a FIFO, a link, a device: never opened, never waited on)
        if read:
            warnings.warn(f"the region of {directory.root} is not read: its claim {e}", stacklevel=3)
            return None
        raise CheckpointDirectoryError(f"the region's claim {e}; delete it to go on (nothing was changed)") from None
    if read:
        if not os.path.lexists(path):
            return None
        found = Region.open(path, access="read", ranks=ranks)
        if found.owner != token:
            found.close()
            warnings.warn(f"the region {path} belongs to another checkpoint directory than {directory.root}: not read",
                          stacklevel=3)
            return None
        return found
    claimed = token is None
    if token is None:
        token = uuid.uuid4().hex
        directory.put_file(claim.name, token.encode())  # before the region: a region is always claimed
    try:
        found = _open_claimed(directory, path, token, flush)
    except BaseException as e:
        if claimed:
            claim.unlink(missing_ok=True)  # the directory stays as it was found
        if isinstance(e, OSError) and not isinstance(e, EverystepError):
            raise ConfigError(f"region={region!r}: the region {path} cannot be made there "
                              f"({e.strerror or e}); give region= a folder of your own on a filesystem in memory "
                              "(/dev/shm) or a disk") from None
        raise
    if found.owner != token:
        found.close()
        raise CheckpointDirectoryError(
            f"the region {path} belongs to another checkpoint directory than {directory.root} (it may hold that "
            f"run's checkpoints, so nothing was changed): give this run its own region= or delete {path}")
    return found


def own_memory_folder(path: Path) -> Path:
    """Where the memory tier ``path`` (``<folder>/<name>/rank-R.bin``) lies: in the user's folder of
    memory tiers (``/dev/shm/everystep-UID``), made mode 0700. Its name is known in advance, so
    another user may have made it: then in a folder of a name no one can know, made for it
    (:func:`spare_memory_folder`), with a warning; the directory's
    record of the tier says where, for the restart."""
    if not MEMORY_ROOT.is_dir():
        raise ConfigError(f"memory=True keeps its region in {MEMORY_ROOT}, which this machine lacks: "
                          "give region= a path on a filesystem in memory (tmpfs)")
    folder = path.parent.parent
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    problem = untrusted_folder(folder)
    if problem is None:
        return path
    if not folder.is_symlink() and folder.stat().st_uid == os.geteuid():  # (this user's own: theirs to mend)
        raise UntrustedRegionError(f"the memory tiers' folder {folder} cannot be trusted: {problem}; "
                                   f"make it this user's alone (chmod 700 {folder}) or delete it")
    spare = spare_memory_folder()  # (another user's, in a sticky folder: this user cannot delete it)
    warnings.warn(f"the memory tiers' folder {folder} cannot be trusted ({problem}): this run's memory tier lies in "
                  f"{spare} instead, which the checkpoint directory records for its restarts; have root delete "
                  f"{folder}", RuntimeWarning, stacklevel=4)
    return spare / path.parent.name / path.name
