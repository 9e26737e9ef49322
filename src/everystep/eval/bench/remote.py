"""Upload throughput of the remote tier's store against boto3's own bulk upload of the same bytes.

``S3Store.put`` (what the remote tier uploads each object with) and boto3's managed transfer
(``upload_fileobj``: its defaults, 8 MiB parts, up to 10 at a time) each upload the same random bytes —
a workload's full checkpoint's size — to the same server, interleaved, ``repeats`` times; the medians
and their ratio are reported. Both write under ``<prefix>/throughput/``, deleted after.
"""

from __future__ import annotations

import io
import os
import statistics
import time
from typing import Any

__all__ = ["upload_throughput"]


def upload_throughput(url: str, nbytes: int, *, repeats: int = 3) -> dict[str, Any]:
    from ...storage.stores import S3Store, client as s3_client

    store = S3Store(url)
    client = s3_client()
    data = os.urandom(nbytes)
    ours, theirs = [], []
    try:
        for r in range(repeats):
            for who in ("everystep", "boto3") if r % 2 == 0 else ("boto3", "everystep"):
                t0 = time.perf_counter()
                if who == "everystep":
                    store.put(f"throughput/everystep-{r}", [data])
                    ours.append(time.perf_counter() - t0)
                else:
                    client.upload_fileobj(io.BytesIO(data), store.bucket, f"{store.prefix}throughput/boto3-{r}")
                    theirs.append(time.perf_counter() - t0)
    finally:
        for r in range(repeats):
            for name in (f"throughput/everystep-{r}", f"throughput/boto3-{r}"):
                store.delete(name)
    ours_bps, theirs_bps = nbytes / statistics.median(ours), nbytes / statistics.median(theirs)
    return {"bytes": nbytes, "repeats": repeats, "everystep_bytes_per_second": ours_bps,
            "boto3_bytes_per_second": theirs_bps, "ratio": ours_bps / theirs_bps,
            "everystep_seconds": ours, "boto3_seconds": theirs}
