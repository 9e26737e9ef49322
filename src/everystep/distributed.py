"""Where this process stands in a torch.distributed job, and the process groups checkpointing uses.

Checkpointing never issues a collective on the group the training uses. Each *channel* — one
thread of checkpoint work that talks to the other ranks — gets a gloo group of its own:

===========  ====================================================================
``full``     commit of full checkpoints (the thread that writes them)
``diff``     commit of differential checkpoints (the differential writer thread)
``control``  start-up barriers and the agreement on a stop (the training thread)
``remote``   uploads to the remote tier, rank 0 leading (its upload thread; made only for a job
             with a remote, :meth:`Ranks.add_channel`)
===========  ====================================================================

Within a group every rank issues the same collectives in the same order, because one thread per
rank issues them, in step order. Across groups no order is assumed, so a background commit can
never deadlock against a barrier or an all-reduce the training thread is waiting in.

PyTorch is imported where a collective is issued, not with this module: a process of one rank that
only reads and writes objects (the upload process, :mod:`everystep.storage.remote.uploader`) holds none of it.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import random
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import PeerFailedError

if TYPE_CHECKING:
    import torch

__all__ = ["Ranks", "CHANNELS", "collective_timeout", "init_process_group", "local_world_size"]

CHANNELS = ("full", "diff", "control")


def collective_timeout() -> float:
    """Seconds a collective waits for its peers: ``EVERYSTEP_COLLECTIVE_TIMEOUT``, default 600 (read
    when a group is made, not at import: a rank forked from a zygote has its own environment)."""
    return float(os.environ.get("EVERYSTEP_COLLECTIVE_TIMEOUT", 600))


@dataclass
class Ranks:
    """This process's rank, the world size, and one process group per checkpoint channel."""

    rank: int = 0
    world: int = 1
    groups: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def detect(cls, *, timeout: float | None = None) -> "Ranks":
        """The job this process is in: a single process unless torch.distributed is initialised.

        IMPORTANT: creating the groups is itself collective; every rank must call this at the
        same point (Checkpointer construction does).
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        seconds = collective_timeout() if timeout is None else timeout
        groups = {
            name: dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds)) for name in CHANNELS
        }
        return cls(rank=dist.get_rank(), world=dist.get_world_size(), groups=groups)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def all_gather(self, channel: str, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, over the channel's own group."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.groups[channel])
        return out

    def exchange(self, channel: str, report: dict[str, Any], error: BaseException | None, what: str) -> list[dict[str, Any]]:
        """Every rank's ``report`` (with its ``error``, if any), in rank order: the step of a commit at
        which the ranks learn whether every part was written. A failure on any rank is raised on
        every rank — its own error where it failed, else a :class:`PeerFailedError` naming the ranks
        that did and their errors' classes."""
        reports = self.all_gather(channel, {**report, "error": f"{type(error).__name__}: {error}" if error else None,
                                            "error_type": type(error).__name__ if error else None})
        failed = {r: p["error_type"] for r, p in enumerate(reports) if p["error"]}
        if failed:
            if error is not None:
                raise error
            raise PeerFailedError(f"{what} was not committed: " + "; ".join(f"rank {r}: {reports[r]['error']}" for r in failed),
                                  failed)
        return reports

    def any(self, channel: str, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any: one small all-reduce."""
        if not self.distributed:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups[channel])
        return bool(t.item())

    def broadcast(self, channel: str, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank, over the channel's own group."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.groups[channel], 0), group=self.groups[channel])
        return box[0]

    def barrier(self, channel: str) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.groups[channel])

    def add_channel(self, name: str, *, timeout: float | None = None) -> None:
        """Give the channel ``name`` a gloo group of its own (collective: every rank calls it at the
        same point); ``timeout``: seconds a collective on it waits for its peers (default:
        :func:`collective_timeout`)."""
        if self.distributed and name not in self.groups:
            import torch.distributed as dist

            seconds = collective_timeout() if timeout is None else timeout
            self.groups[name] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))

    def send_bytes(self, channel: str, data: bytes | bytearray | memoryview | None, to: int) -> None:
        """Send ``data`` to rank ``to`` over the channel's group (None: say that there is nothing to
        send); the rank calls :meth:`recv_bytes` at the same point of its own sequence."""
        import torch
        import torch.distributed as dist

        group = self.groups[channel]
        size = -1 if data is None else memoryview(data).nbytes
        dist.send(torch.tensor([size], dtype=torch.int64), dist.get_global_rank(group, to), group=group)
        if size > 0:
            dist.send(torch.frombuffer(data, dtype=torch.uint8), dist.get_global_rank(group, to), group=group)

    def recv_bytes(self, channel: str, source: int) -> bytearray | None:
        """What rank ``source`` sends with :meth:`send_bytes` (None where it had nothing to send)."""
        import torch
        import torch.distributed as dist

        group = self.groups[channel]
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, dist.get_global_rank(group, source), group=group)
        if size.item() < 0:
            return None
        data = bytearray(int(size.item()))
        if data:
            dist.recv(torch.frombuffer(data, dtype=torch.uint8), dist.get_global_rank(group, source), group=group)
        return data

    def owners(self, sizes: dict[str, int], able: dict[str, list[int]] | None = None) -> dict[str, int]:
        """The rank that handles each item of ``sizes`` (bytes by name): the largest first, each to
        the rank with the fewest bytes so far (of the ranks ``able`` names for it, where it names
        any) — the same answer on every rank."""
        load = [0] * self.world
        owners = {}
        for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
            rank = min((able or {}).get(key) or range(self.world), key=lambda r: (load[r], r))
            owners[key] = rank
            load[rank] += max(sizes[key], 1)
        return owners


def local_world_size() -> int:
    """The processes of this job on this machine (``LOCAL_WORLD_SIZE``, which torchrun sets; 1
    without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (a job's rendezvous on one machine).

    Drawn at random below the kernel's range of ephemeral ports, where it was free when tried: a port
    the kernel hands out (to gloo's connections, to a ``bind`` to port 0) could be taken again by any
    process before the rendezvous binds it, and then one rank fails to start while the others wait
    for it. Only a process that binds ports by number can take one down here. Where the range cannot
    be read or nothing below it is free, a port the kernel hands out."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = range(10000, low) if low > 10000 else range(0)
    for port in random.SystemRandom().sample(candidates, min(len(candidates), 50)):  # (whatever seeded `random`)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group(*, one_process: bool = False, device: str = "cpu") -> bool:
    """Join the job's process group (``RANK``/``WORLD_SIZE`` set by ``torchrun`` or the supervisor)
    or, with ``one_process``, make a group of this process alone (DistributedDataParallel needs one
    for its communication hooks): gloo for training on the CPU, NCCL for ``device`` ``cuda``.
    everystep's own channels are gloo groups either way. True when this call created it, to destroy
    later."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=collective_timeout())
    backend = "nccl" if device == "cuda" else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend, timeout=timeout)
        return True
    if one_process:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return True
    return False


def sample_digests(tensors: dict[str, torch.Tensor], keys: list[str], sample: int = 64) -> dict[str, str]:
    """A cheap fingerprint of each of ``keys``: dtype, shape and up to ``sample`` elements from each end."""
    import torch

    out = {}
    for key in sorted(keys):
        t = tensors[key].detach()
        flat = t.reshape(-1)
        picked = torch.cat([flat[:sample], flat[-sample:]]) if flat.numel() > 2 * sample else flat
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(picked.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out[key] = h.hexdigest()[:16]
    return out
