"""The replay engine, as a property: whatever the optimizer, its settings, the gradients and the
steps a GradScaler skipped, replaying the step records gives bitwise the state training reached."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from everystep.compress import decompress, parameter_names
from everystep.replay import Replayer, StepRecord
from everystep.state import group_scalars

OPTIMIZERS: dict[str, Any] = {
    "sgd": lambda d: (torch.optim.SGD, {"lr": 0.1, "momentum": d(st.sampled_from([0.0, 0.9])),
                                         "nesterov": False, "weight_decay": d(st.sampled_from([0.0, 1e-2]))}),
    "nesterov": lambda d: (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "adam": lambda d: (torch.optim.Adam, {"lr": 1e-2, "betas": (d(st.sampled_from([0.8, 0.9])), 0.999),
                                           "amsgrad": d(st.booleans())}),
    "adamw": lambda d: (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": d(st.sampled_from([0.0, 0.1]))}),
    "rmsprop": lambda d: (torch.optim.RMSprop, {"lr": 1e-2, "momentum": d(st.sampled_from([0.0, 0.5])),
                                                 "centered": d(st.booleans())}),
    "adagrad": lambda d: (torch.optim.Adagrad, {"lr": 1e-2}),
}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        tensors += [v.clone() for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return tensors


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(sorted(OPTIMIZERS)), seed=st.integers(0, 2**16),
       steps=st.integers(1, 6), threads=st.integers(1, 3))
def test_replay_equals_training_bitwise(data, kind, seed, steps, threads):
    cls, options = OPTIMIZERS[kind](data.draw)
    model = _model(seed)
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": options["lr"] / 2}]
    optimizer = cls(groups, **options)
    start = [p.detach().clone() for p in model.parameters()]
    names = parameter_names(model)
    generator = torch.Generator().manual_seed(seed)
    records = []
    for step in range(1, steps + 1):
        skipped = data.draw(st.booleans(), label=f"skipped {step}")
        for g in optimizer.param_groups:  # a schedule changes the learning rate between steps
            g["lr"] = g["lr"] * data.draw(st.sampled_from([1.0, 0.5, 1.5]), label=f"lr factor {step}")
        grads: dict[str, dict[str, torch.Tensor]] = {}
        for p in model.parameters():
            if data.draw(st.integers(0, 5), label="gradless") == 0:
                continue  # a parameter without a gradient this step
            dense = torch.randn(p.shape, generator=generator) * 10 ** data.draw(st.integers(-3, 2), label="scale")
            if data.draw(st.booleans(), label="top-k"):
                k = max(1, dense.numel() // 3)
                indices = dense.reshape(-1).abs().topk(k).indices.sort().values.to(torch.int32)
                grads[names[p]] = {"values": dense.reshape(-1)[indices.long()], "indices": indices}
            else:
                grads[names[p]] = {"dense": dense}
        if not skipped:
            for p in model.parameters():
                p.grad = decompress(grads[names[p]], p) if names[p] in grads else None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        records.append(StepRecord(step=step, skipped=skipped, groups=group_scalars(optimizer), grads=grads))

    again = _model(seed + 1)
    with torch.no_grad():
        for p, value in zip(again.parameters(), start):
            p.copy_(value)
    fresh_groups = [{"params": list(again[0].parameters())}, {"params": list(again[2].parameters()), "lr": options["lr"] / 2}]
    replayed = cls(fresh_groups, **options)
    assert Replayer(again, replayed, threads=threads).apply(records) == steps
    for a, b in zip(_state(model, optimizer), _state(again, replayed), strict=True):
        assert torch.equal(a, b)
