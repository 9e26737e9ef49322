"""A process that uploads a checkpoint's objects to the remote store, from the local directory.

An upload's work is Python's as much as the network's: each object read back and verified against
its checksum, then boto3's multipart upload — request signing, the parts' checksums, the HTTP of each
part. In a thread of the training process all of that shares the interpreter's lock with the
training thread. So each rank that uploads (:class:`~everystep.storage.remote.tier.RemoteTier`) hands
its share of an upload to an :class:`UploadProcess`: a child process in a fresh interpreter (never
a fork of a process that may hold a CUDA context) that imports the object store and not PyTorch,
reads the objects from the local directory (read-only) and puts them; the tier's thread only sends
the names and waits for the answer. The tier keeps everything else — the lock, the manifest put
last, retention, the ranks' exchanges — so a checkpoint becomes visible remotely exactly as before.

The two talk over a socket pair made before the child starts, so nothing else can reach it.
Messages are JSON (never pickle): training → uploader ``{"put": [object, ...]}`` (each an
:class:`~everystep.storage.base.ObjectInfo`'s JSON) or ``{"close": true}``; uploader → training
``{"nbytes": n}`` once every object is up, or ``{"error": message, "corrupt": bool}``. The child dies
with its parent (``PR_SET_PDEATHSIG``), so a killed training process leaves no upload going; a crash
point that fires in the child kills the training process too, so a fault injected mid-upload
means what it means in a thread. It inherits the environment, so credentials and the endpoint come
from the same AWS chain, and are never on its command line. A child that died is started again at
the next upload.
"""

from __future__ import annotations

import json
from multiprocessing import connection
from pathlib import Path

from ..._process import HelperClient, run_helper
from ...errors import CorruptCheckpointError, RemoteStoreError
from ..base import ObjectInfo

__all__ = ["UploadProcess"]

_MAIN = "import sys; from everystep.storage.remote.uploader import main; sys.exit(main(sys.argv[1:]))"


class UploadProcess(HelperClient):
    """The training side: starts the uploader for the store at ``url`` and the local directory at
    ``root``, and has it put objects (:meth:`put`)."""

    def __init__(self, url: str, root: Path) -> None:
        self.url, self.root = url, Path(root)
        super().__init__(_MAIN, str(self.root), url, name=f"uploading to {url}: the upload process",
                         failure=RemoteStoreError)
        self.start()

    def put(self, objects: list[ObjectInfo]) -> int:
        """Upload ``objects`` from the local directory, each verified against its checksum on the way
        out, under the same names; the bytes uploaded. Raises :class:`CorruptCheckpointError` when a
        local object does not verify, :class:`RemoteStoreError` when an upload failed or the uploader
        is gone (started again at the next call)."""
        answer = self.ask({"put": [o.to_json() for o in objects]})
        if "error" in answer:
            raise (CorruptCheckpointError if answer.get("corrupt") else RemoteStoreError)(str(answer["error"]))
        return int(answer["nbytes"])


def _serve(conn: connection.Connection, root: Path, url: str) -> None:
    from ..._faults import crash_point
    from ..catalog import Catalog
    from ..stores.local import LocalStore
    from ..stores.location import open_remote

    local = Catalog(LocalStore(root, access="read"))  # (a reader: nothing of the directory is changed here)
    remote = Catalog(open_remote(url))
    try:
        while True:
            message = json.loads(conn.recv_bytes())
            if not isinstance(message, dict) or "put" not in message:
                return  # close
            try:
                total = 0
                for info in map(ObjectInfo.from_json, message["put"]):
                    crash_point("remote.object")  # (an object of the share, before its upload)
                    total += remote.put_object(info, local.read_object(info))
            except Exception as e:  # (sent whole to the tier, which reports it once)
                corrupt = isinstance(e, CorruptCheckpointError)
                conn.send_bytes(json.dumps({"error": str(e), "corrupt": corrupt}).encode())
                continue
            conn.send_bytes(json.dumps({"nbytes": total}).encode())
    finally:
        remote.close()


def main(argv: list[str]) -> int:
    return run_helper(argv, lambda conn, root, url: _serve(conn, Path(root), url), "upload process")
