"""Traces of where a step's time goes, in the Chrome trace format that Perfetto and ``chrome://tracing``
open: spans on the training thread (each step, each of everystep's calls in it), on every everystep
thread (each job of a :class:`~everystep.background.Worker`: copies, commits, persists), in the
helper processes (the region's hashing process, the checkpoint agent), and on a GPU the copy
streams' work, timed by CUDA events.

Off unless started: :func:`span` then costs one global read. :func:`start` records this process's
spans and, through :data:`ENV`, tells the processes it starts to record theirs beside it
(:func:`start_from_env`); :func:`stop` writes this process's file, and :func:`merge` gathers a run's
files into one. A helper process writes each span as it ends (a line of ``STEM.PID.part.jsonl``):
it may be killed with its parent, or with the thread that started it, without a word. Times are
the monotonic clock's, which every process on a machine shares, in microseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["ENV", "span", "job", "device_span", "start", "start_from_env", "stop", "run_stem", "merge", "merge_all", "active",
           "load"]

ENV = "EVERYSTEP_TRACE"
"""Set by :func:`start` for the processes this one starts: the path stem each writes its own part
to (``STEM.PID.part.jsonl``), for :func:`merge`."""


class _Recorder:
    def __init__(self, stem: str, role: str, *, through: bool = False) -> None:
        self.stem, self.role, self.pid = stem, role, os.getpid()
        self.sink = open(f"{stem}.{self.pid}.part.jsonl", "a", buffering=1) if through else None
        """A helper's: each event written as it ends, a line each."""
        self.lock = threading.Lock()
        self.events: list[tuple[str, int, int, int, dict[str, Any] | None]] = []
        """(name, thread id, start µs, duration µs, args): appended from any thread (atomic under the GIL)."""
        self.threads: dict[int, str] = {}
        self.device: list[tuple[str, str, Any, Any, dict[str, Any] | None]] = []
        """CUDA: (name, stream's track, start event, end event, args), timed at :func:`stop`."""
        self.anchor: tuple[Any, int] | None = None
        """CUDA: an event on the device and the host time it passed at (the device clock's origin)."""
        if self.sink is not None:
            self.write(_named("process_name", self.pid, 0, f"{role} ({self.pid})"))

    def write(self, event: dict[str, Any]) -> None:
        assert self.sink is not None
        with self.lock:
            self.sink.write(json.dumps(event) + "\n")


_recorder: _Recorder | None = None


def _now() -> int:
    return time.monotonic_ns() // 1000


def active() -> bool:
    """Whether this process records spans."""
    return _recorder is not None


def _named(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    """The trace's metadata event naming a process (``process_name``) or a thread (``thread_name``)."""
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def _span_event(name: str, pid: int, tid: int, ts: int, dur: int, args: dict[str, Any] | None) -> dict[str, Any]:
    """The trace's event of a span (``X``: complete, with its duration)."""
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, **({"args": args} if args else {})}


@contextlib.contextmanager
def _recording(name: str, args: dict[str, Any] | None) -> Iterator[None]:
    r = _recorder
    assert r is not None
    tid = threading.get_native_id()
    if tid not in r.threads:
        r.threads[tid] = threading.current_thread().name
        if r.sink is not None:
            r.write(_named("thread_name", r.pid, tid, r.threads[tid]))
    t0 = _now()
    try:
        yield
    finally:
        if r.sink is None:
            r.events.append((name, tid, t0, _now() - t0, args))
        else:
            r.write(_span_event(name, r.pid, tid, t0, _now() - t0, args))


_OFF = contextlib.nullcontext()
"""What a span is while tracing is off (stateless: one serves every call)."""
_NUMBERS = re.compile(r"\d+")


def span(name: str, **args: Any) -> contextlib.AbstractContextManager[None]:
    """A span of this thread's time named ``name`` (``args``: shown beside it), recorded when tracing is on."""
    if _recorder is None:
        return _OFF
    return _recording(name, args or None)


def job(what: str) -> contextlib.AbstractContextManager[None]:
    """The span of a background job that does ``what``: named by it with its numbers as ``N`` (one
    name for every step's job), ``what`` itself beside it; the name made only when tracing is on."""
    if _recorder is None:
        return _OFF
    return _recording(_NUMBERS.sub("N", what), {"what": what})


@contextlib.contextmanager
def _device_recording(name: str, stream: Any, args: dict[str, Any] | None) -> Iterator[None]:
    import torch

    r = _recorder
    assert r is not None
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record(stream)
    try:
        yield
    finally:
        end.record(stream)
        r.device.append((name, f"cuda stream {stream.stream_id}", begin, end, args))


def device_span(name: str, stream: Any, **args: Any) -> contextlib.AbstractContextManager[None]:
    """A span of ``stream``'s work (a CUDA stream; None: nothing on a device) issued inside it, timed
    by CUDA events, recorded when tracing is on."""
    if _recorder is None or stream is None:
        return _OFF
    if _recorder.anchor is None:
        _anchor(_recorder)
    return _device_recording(name, stream, args or None)


def _anchor(r: _Recorder) -> None:
    import torch

    torch.cuda.synchronize()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    event.synchronize()
    r.anchor = (event, _now())


def start(stem: str | os.PathLike[str], role: str = "training process") -> None:
    """Record this process's spans, to be written to ``STEM.PID.part.json`` by :func:`stop`; the
    processes started from here on record theirs beside it."""
    global _recorder
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    _recorder = _Recorder(str(stem), role)
    os.environ[ENV] = str(stem)


def start_from_env(role: str) -> bool:
    """In a helper process: record its spans where the process that started it records its own
    (:data:`ENV`); whether it does."""
    stem = os.environ.get(ENV)
    if not stem:
        return False
    global _recorder
    try:
        _recorder = _Recorder(stem, role, through=True)
    except OSError:  # (its folder gone: a helper outliving the run its trace was for)
        return False
    return True


def stop() -> Path | None:
    """Write this process's spans (``STEM.PID.part.json``; a helper's: close its file) and stop
    recording; the path (None: not recording)."""
    global _recorder
    r, _recorder = _recorder, None
    if r is None:
        return None
    if r.sink is not None:
        with r.lock:
            r.sink.close()
        return Path(r.sink.name)
    if os.environ.get(ENV) == r.stem:
        del os.environ[ENV]
    events = [_named("process_name", r.pid, 0, f"{r.role} ({r.pid})")]
    events += [_named("thread_name", r.pid, tid, name) for tid, name in r.threads.items()]
    events += [_span_event(name, r.pid, tid, ts, dur, args) for name, tid, ts, dur, args in list(r.events)]
    events += _device_events(r)
    path = Path(f"{r.stem}.{r.pid}.part.json")
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _device_events(r: _Recorder) -> list[dict[str, Any]]:
    if not r.device or r.anchor is None:
        return []
    import torch

    torch.cuda.synchronize()
    anchor, host = r.anchor
    tracks: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    for name, track, begin, end, args in r.device:
        tid = tracks.setdefault(track, -1 - len(tracks))  # (negative: no thread has such an id)
        events.append(_span_event(name, r.pid, tid, host + int(anchor.elapsed_time(begin) * 1000),
                                  max(int(begin.elapsed_time(end) * 1000), 0), args))
    events += [_named("thread_name", r.pid, tid, track) for track, tid in tracks.items()]
    return events


def run_stem(folder: str | os.PathLike[str], name: str, repeat: int) -> Path:
    """Where the trace of a bench's run of ``name`` in repeat ``repeat`` (from 0) goes: ``NAME_rN`` in
    ``folder``, what of the name is not a letter, a digit, ``_``, ``+`` or ``-`` as ``@`` (no dot: it
    separates a trace's parts)."""
    return Path(folder) / f"{re.sub(r'[^A-Za-z0-9_+-]', '@', name)}_r{repeat + 1}"


def merge(stem: str | os.PathLike[str]) -> Path | None:
    """Gather the parts every process of a run wrote under ``stem`` into ``STEM.json`` (added to what
    it holds: a helper that outlived the run writes its part later; the parts removed); its path, or
    None where nothing was written."""
    stem = Path(stem)
    parts = sorted(stem.parent.glob(f"{stem.name}.*.part.json*"))
    path = stem.with_name(stem.name + ".json")
    if not parts:
        return path if path.is_file() else None
    events: list[dict[str, Any]] = json.loads(path.read_text())["traceEvents"] if path.is_file() else []
    for part in parts:
        if part.suffix == ".jsonl":  # (a helper's: its last line may be cut where it was killed)
            lines = part.read_text().splitlines()
            events += [json.loads(line) for line in lines if line.endswith("}")]
        else:
            events += json.loads(part.read_text())["traceEvents"]
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    for part in parts:
        part.unlink()
    return path


def merge_all(folder: str | os.PathLike[str]) -> list[Path]:
    """:func:`merge` every run's trace in ``folder`` (what helpers that outlived their run wrote since)."""
    stems = sorted({p.name.split(".", 1)[0] for p in Path(folder).glob("*.json*")})
    return [path for stem in stems if (path := merge(Path(folder) / stem)) is not None]


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A trace this module wrote (``.json``, or gzipped ``.json.gz``), as JSON."""
    import gzip

    path = Path(path)
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(data)
