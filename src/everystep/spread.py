"""GoCkpt's ``spread`` checkpoint: the parts of one checkpoint as they were copied, each at its own
version, with the gradients that bring each part to the checkpoint's step.

``reconstruct="device"`` (:mod:`everystep.strategies.gockpt`) writes it (:func:`write_spread`); recovery reads it
(:func:`read_spread`, verified as every checkpoint is) and brings the parts forward on the training
device (:func:`bring_forward`): each chunk by the updates after its copy, with the training
optimizer's class and each update's group settings — the updates of training again, so bitwise.
A part brought forward is checked against the state of the step before anything is restored.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import CorruptCheckpointError, NoValidCheckpointError
from .recovery import Candidate, Shards, recover
from .storage import read_state_together, Manifest, malformed, SPREAD_KIND
from .replay import optimizer_like, replay_step
from .storage.formats import RankShare, commit_parts, commit_tensors

if TYPE_CHECKING:
    from .storage import Catalog, CheckpointDirectory
    from .storage.remote import Pulled

__all__ = ["SPREAD_KIND", "write_spread", "spread_state", "commit_spread", "read_spread", "bring_forward",
           "recover_spread"]


def write_spread(catalog: "Catalog", step: int, state: dict[str, torch.Tensor], skeleton: Any, replicated: set[str], *,
                 start: int, params: Sequence[Any], copied: Sequence[Sequence[Any]],
                 records: Sequence[tuple[dict[str, Any], dict[int, torch.Tensor]]], distributed: bool,
                 error: BaseException | None = None) -> None:
    """Commit S_step as a spread checkpoint, from every rank (a collective): ``state`` is S_step's flat
    state, each part as it was copied at its own version; the rest as :func:`spread_state` takes it.
    ``error``: this rank failed; nothing is committed and the failure is raised on every rank."""
    if error is not None:
        commit_parts(catalog, "full", kind=SPREAD_KIND, step=step, chunks=None, share=RankShare({}, {}), meta={},
                     rank_meta={}, error=error)
    tensors, description = spread_state(state, start=start, params=params, copied=copied, records=records)
    if distributed:  # the gradients are the all-reduced ones, the same on every rank
        replicated = replicated | {k for k in tensors if k.startswith("spread/")}
    commit_spread(catalog, step, tensors, skeleton, description, replicated)


def spread_state(state: dict[str, torch.Tensor], *, start: int, params: Sequence[Any], copied: Sequence[Sequence[Any]],
                 records: Sequence[tuple[dict[str, Any], dict[int, torch.Tensor]]]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A spread checkpoint's tensors and description: ``state`` (S_step's flat state, each part as it
    was copied at its own version), ``params`` the parameters cut into parts (each with ``key``,
    ``group``, ``elementwise`` and ``whole``: its state tensors chunked with it, and the others),
    ``copied`` each part's chunks (``index``, ``param``, ``start``, ``stop`` and ``state``, the chunk's
    copy of the parameter's ``whole`` state), ``records`` each update after the copies began: its step
    and group settings, and the gradients kept, by chunk index."""
    tensors, scalars = dict(state), {}
    for c in (c for part in copied for c in part):
        for name, value in c.state.items():
            if name in params[c.param].whole:
                if isinstance(value, torch.Tensor):
                    tensors[f"spread/state/{c.index}/{name}"] = value.to("cpu")
                else:
                    scalars[f"{c.index}/{name}"] = value
    kept = []
    for record, grads in records:
        kept.append({**record, "chunks": sorted(grads)})
        tensors.update({f"spread/grad/{record['step']}/{i}": g for i, g in grads.items()})
    return tensors, {
        "start": start,
        "params": [{"key": p.key, "group": p.group, "elementwise": p.elementwise, "whole": p.whole} for p in params],
        "chunks": [[k, c.param, c.start, c.stop] for k, part in enumerate(copied) for c in part],
        "records": kept,
        "scalars": scalars,
    }


def commit_spread(catalog: "Catalog", step: int, tensors: dict[str, torch.Tensor], skeleton: Any,
                  description: dict[str, Any], replicated: set[str] | frozenset[str] = frozenset()) -> None:
    """Commit what :func:`spread_state` made as the spread checkpoint of ``step``."""
    commit_tensors(catalog, "full", kind=SPREAD_KIND, step=step, tensors=tensors, replicated=set(replicated), meta={},
                   rank_meta={"skeleton": skeleton, "spread": description})


def read_spread(directory: "CheckpointDirectory", manifest: Manifest) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """A spread checkpoint's state tree (its parts as copied), all its tensors, and its description;
    CorruptCheckpointError when it does not verify (on every rank at once under node-local disks)."""
    tree, tensors, meta = read_state_together(directory, manifest)
    if "spread" not in meta:
        raise CorruptCheckpointError(f"checkpoint {manifest.name}: lacks spread")
    description = meta["spread"]
    with malformed(f"checkpoint {manifest.name}"):
        missing = [f"spread/grad/{r['step']}/{x}" for r in description["records"] for x in r["chunks"]
                   if f"spread/grad/{r['step']}/{x}" not in tensors]
    if missing:
        raise CorruptCheckpointError(f"checkpoint {manifest.name} lacks the gradient {missing[0]!r}")
    return tree, tensors, description


def bring_forward(optimizer: torch.optim.Optimizer, trained: dict[str, tuple[int, torch.Tensor]], step: int,
                  tree: dict[str, Any], tensors: dict[str, torch.Tensor], description: dict[str, Any]) -> str:
    """Apply the gradients a spread checkpoint holds to its parts, in ``tree`` (its state as
    copied, read from storage; the parts it trains moved to the training device): each chunk by
    the updates after its copy, with the training optimizer's class and each update's group
    settings. ``trained``: the live model's keys of the parameters ``optimizer`` trains, with each
    one's index in its state and the parameter. Raises :class:`CorruptCheckpointError` when a part
    brought forward disagrees with the state of the step. Returns the device."""
    what = f"the spread checkpoint at step {step}"
    params, held_states = [], []
    for d in description["params"]:
        found = trained.get(d["key"])
        if found is None or not d["key"].startswith("/model/"):
            raise CorruptCheckpointError(f"{what} brings forward {d['key']!r}, which the optimizer does not train")
        index, param = found
        device = param.device
        model, key = tree["model"], d["key"][len("/model/"):]
        stored = model[key]
        moved = stored.to(device)
        for name, value in model.items():  # tied weights stay one tensor
            if value is stored:
                model[name] = moved
        held = tree["optimizer"]["state"].get(index, {})
        held.update({k: v.to(device) for k, v in held.items() if isinstance(v, torch.Tensor) and v.dim()})
        params.append((model[key], d))
        held_states.append(held)
    chunks = description["chunks"]
    for chunk in chunks:
        _, i, start, stop = chunk
        if not all(type(v) is int for v in chunk) or not 0 <= i < len(params) \
                or not 0 <= start <= stop <= params[i][0].numel():
            raise ValueError(f"its chunk {chunk!r} is not a range of a parameter it brings forward")
    views: list[torch.Tensor] = []
    states: list[dict[str, Any]] = []
    with torch.no_grad():
        for index, (_, i, start, stop) in enumerate(chunks):
            p, d = params[i]
            held = held_states[i]
            views.append(p.view(-1)[start:stop])
            state = {name: held[name].view(-1)[start:stop] for name in d["elementwise"]}
            for name in d["whole"]:
                value = tensors.get(f"spread/state/{index}/{name}", description["scalars"].get(f"{index}/{name}"))
                if isinstance(value, torch.Tensor) and isinstance(held.get(name), torch.Tensor):
                    value = value.to(device=held[name].device, dtype=held[name].dtype)
                state[name] = value
            states.append(state)
    for record in description["records"]:  # each gradient the length of its chunk, before any is applied
        for x in record["chunks"]:
            grad = tensors[f"spread/grad/{record['step']}/{x}"]
            if not 0 <= x < len(views) or grad.numel() != views[x].numel():
                raise ValueError(f"its gradient {x} of step {record['step']} does not fit the chunk it names")
    group_of = [params[i][1]["group"] for _, i, _, _ in chunks]
    for record in description["records"]:
        j = record["step"] - description["start"]  # parts 1..j were copied before this update
        active = [x for x, chunk in enumerate(chunks) if chunk[0] < j]
        groups = sorted({group_of[x] for x in active})
        made = optimizer_like(optimizer, {g: [(views[x], states[x]) for x in active if group_of[x] == g]
                                          for g in groups})
        present = set(record["chunks"])
        try:  # (the copy read from storage, not the live state: a replay that fails leaves nothing behind)
            replay_step(made, [record["groups"][g] for g in groups],
                        ((views[x], tensors[f"spread/grad/{record['step']}/{x}"].to(views[x].device) if x in present
                          else None) for x in active))
        except (AssertionError, ArithmeticError, RuntimeError) as e:  # settings the optimizer refuses to step with
            raise CorruptCheckpointError(f"{what}: its update of step {record['step']} does not replay "
                                         f"({type(e).__name__}: {e})") from None
    for x, (_, i, _, _) in enumerate(chunks):
        _, d = params[i]
        for name in d["whole"]:
            value, held = states[x][name], held_states[i].get(name)
            same = torch.equal(value.cpu(), held.cpu()) if isinstance(value, torch.Tensor) else value == held
            if not same:
                raise CorruptCheckpointError(f"{what}: the part of {d['key']!r} brought forward disagrees with the "
                                             f"state of the step on {name!r}")
    return str(views[0].device) if views else "cpu"


def recover_spread(directory: "CheckpointDirectory", optimizer: torch.optim.Optimizer,
                   trained: Callable[[], dict[str, tuple[int, torch.Tensor]]], shards: Shards,
                   pulled: "Pulled | None" = None) -> Candidate | None:
    """The newest checkpoint in ``directory`` that verifies, full (read as :func:`~everystep.recovery.recover`
    reads it, ``shards`` and ``pulled`` as there) or spread (its parts brought forward with ``optimizer`` on the
    training device; ``trained()``: as :func:`bring_forward` takes it); None for an empty directory."""
    t0 = time.perf_counter()
    records = directory.catalog.manifests()
    newest_full = directory.newest_full_step(records)
    spreads = sorted((r.manifest for r in records if r.manifest and r.manifest.kind == SPREAD_KIND),
                     key=lambda m: -m.step)
    found = _first_spread(directory, optimizer, trained, [m for m in spreads if m.step > newest_full], t0)
    if found is not None:
        return found
    failed: NoValidCheckpointError | None = None
    try:
        full = recover(directory, shards=shards, pulled=pulled)  # the newest that verifies, warning about others
    except NoValidCheckpointError as e:  # none does: a spread one older than them may
        full, failed = None, e
    above = full.step if full is not None else -1
    found = _first_spread(directory, optimizer, trained, [m for m in spreads if above < m.step <= newest_full], t0)
    if found is None and failed is not None:  # (a newer full checkpoint failed)
        raise failed
    return found or full


def _first_spread(directory: "CheckpointDirectory", optimizer: torch.optim.Optimizer,
                  trained: Callable[[], dict[str, tuple[int, torch.Tensor]]], manifests: list[Manifest],
                  t0: float) -> Candidate | None:
    """The first of ``manifests`` (newest first) that verifies and comes forward."""
    if not manifests:
        return None
    params = trained()
    for manifest in manifests:
        try:
            tree, tensors, description = read_spread(directory, manifest)
            with malformed(f"the spread checkpoint at step {manifest.step}"):
                device = bring_forward(optimizer, params, manifest.step, tree, tensors, description)
        except CorruptCheckpointError as e:
            warnings.warn(f"skipping the spread checkpoint at step {manifest.step}: {e}", stacklevel=5)
            continue
        return Candidate(step=manifest.step, tree=tree, source=f"disk (parts brought forward on {device})",
                         manifest=manifest, seconds=time.perf_counter() - t0)
    return None
