"""Replicas on peers: each rank's own state kept, every step, in the memory of a rank on another host.

Under data parallelism what a lost host takes with it is only what is per rank — random
generators, the data position, buffers, compression residuals — and, in a sharded job, the rank's
shards: the replicated parameters and optimizer state are in every survivor's memory. So each rank
sends that part of the state (its *own* keys, and the skeleton with the scalars) to its *buddy*,
a rank on the next host, which keeps it in a two-slot region of its own (a *mirror*, beside its
region: ``<region>.mirror``, one per rank it mirrors; LowDiff+'s agents keep it instead, and under
sharding keep a replica of the rank's whole state that its gradient shards bring forward:
:mod:`everystep.strategies.lowdiff_plus`). After a restart the ranks agree on the
newest step for which every rank's own part is in some survivor's memory (its region, or its
buddy's mirror) and the replicated part in some region; the ranks that lost theirs receive them
from the survivors over the job's own process group, storage untouched.

Hosts: ``EVERYSTEP_HOST`` where set, else the machine's name. (Not torchrun's node rank: an elastic
restart may number the nodes anew, and a host must keep its name to find its own memory.)
Buddies: the hosts in the order of their first rank; the i-th rank of a host mirrors to the i-th
rank (modulo their number) of the next host, so losing any one host leaves every rank's own state
on another. Two hosts lost at once may take a rank's state and its mirror: recovery then reads
storage, as without mirrors.

The wire: a length (int64), then one buffer — a JSON header (what a region slot's metadata holds:
the step, the rank whose state it is, the skeleton, each tensor's dtype, shape, place and
checksum) followed by the tensors' bytes. Nothing received is unpickled; every checksum is
verified before a tensor is used (I8).
"""

from .base import Agreed, Peers, Traffic
from .mirror import commit_mirror, mirror_path, mirrored, open_read, read_step, read_steps
from .plan import Holdings, ReadHeld, Transfer, plan_recovery, put_together, warn_nothing_whole
from .team import CHANNEL, Team, buddies, host_name, share_out
from .wire import STATE_STEP, WHOLE_STATE, pack, receive, send, swap, unpack

__all__ = ["host_name", "Peers", "Agreed", "Team", "buddies", "mirrored", "pack", "unpack", "mirror_path", "Holdings",
           "plan_recovery", "Transfer", "commit_mirror", "read_step", "read_steps", "open_read", "send", "receive", "swap",
           "share_out", "put_together", "warn_nothing_whole", "Traffic", "WHOLE_STATE", "STATE_STEP", "CHANNEL", "ReadHeld"]
