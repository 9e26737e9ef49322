"""State capture: flatten/unflatten round trips, the state hash, RNG capture."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from everystep.state import capture_rng, restore_rng
from everystep.tree import flatten, state_hash, unflatten

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=5))
tensors = st.builds(
    lambda shape, dtype, seed: (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10).to(dtype),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.uint8]),
    st.integers(0, 1000),
)
trees = st.recursive(
    st.one_of(scalars, tensors),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text("abc", min_size=1, max_size=3), children, max_size=3),
        st.dictionaries(st.integers(0, 5), children, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_flatten_round_trip_preserves_structure_and_bits(tree):
    tensors_, skeleton = flatten({"root": tree})
    back = unflatten(skeleton, {k: v.clone() for k, v in tensors_.items()})
    assert state_hash(back) == state_hash({"root": tree})
    assert type(back["root"]) is type(tree)


def test_tied_tensors_are_stored_once_and_restored_to_both_names():
    w = torch.randn(8, 4)
    tree = {"model": {"wte.weight": w, "lm_head.weight": w, "other": w[:2]}}
    tensors_, skeleton = flatten(tree)
    assert len(tensors_) == 2  # the full view once, and the distinct slice
    back = unflatten(skeleton, tensors_)
    assert back["model"]["lm_head.weight"] is back["model"]["wte.weight"]
    assert torch.equal(back["model"]["other"], w[:2])


def test_flatten_refuses_objects_that_would_need_pickle():
    with pytest.raises(TypeError, match="'/x' has type object"):
        flatten({"x": object()})


def test_state_hash_ignores_layout_and_order_but_sees_every_value():
    a = torch.arange(12.0).reshape(3, 4)
    t1 = {"a": a.t().contiguous().t(), "b": 1.5, "c": [1, 2]}
    t2 = {"c": [1, 2], "b": 1.5, "a": a.clone()}
    assert not t1["a"].is_contiguous()
    assert state_hash(t1) == state_hash(t2)
    changed = a.clone()
    changed[2, 3] = torch.nextafter(changed[2, 3], torch.tensor(100.0))
    assert state_hash({**t2, "a": changed}) != state_hash(t2)
    assert state_hash({**t2, "b": 1.5000001}) != state_hash(t2)
    assert state_hash({**t2, "a": a.double()}) != state_hash(t2)


def test_rng_capture_restores_every_generator():
    state = capture_rng()
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(5), random.random(), np.random.rand()
    restore_rng(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


def _trained(optimizer: str, seed: int, steps: int = 2):
    """mlp (``optimizer``: ``adamw``, or ``in_backward`` for updates during backward) trained ``steps`` steps."""
    from everystep.eval.workloads import build

    w = build("mlp", seed=seed, in_backward=optimizer == "in_backward")
    for _ in range(steps):
        w.loss(w.data.next()).backward()
        w.update()
    return w


def _as_views(tree):
    """``tree`` with each tensor of its optimizer state a view into a buffer larger than it, as a
    region's slot hands them on, and their flat keys: borrowed (each goes into the live optimizer's
    own tensor where it has one, else into a copy)."""
    def view(t):
        return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)

    state = {i: {k: view(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
             for i, entry in tree["optimizer"]["state"].items()}
    borrowed = frozenset(f"/optimizer/state/{i}/{k}" for i, entry in state.items() for k in entry)
    return {**tree, "optimizer": {**tree["optimizer"], "state": state}}, borrowed


@pytest.mark.parametrize("stored", ["tensors", "views"])
@pytest.mark.parametrize("fails", ["data", "model"])
@pytest.mark.parametrize("optimizer", ["adamw", "in_backward"])
def test_a_load_that_fails_part_way_puts_every_live_object_back_as_it_was(optimizer, fails, stored):
    """A load fails part way — the data loader's own ``load_state_dict`` after the optimizer's, or a
    hook of the model's after some of its layers are loaded (the model loads last): the model's
    tensors, the optimizer's state and groups and the RNG are back as they were, bitwise (the
    optimizer's from its own tensors, which loading replaced without writing into them, or, where
    the stored state is views it loads into those tensors, wrote into last; the model's from a copy,
    taken where its load can fail: it writes into its tensors)."""
    from everystep.errors import StateMismatchError
    from everystep.state import TrainingComponents

    other, w = _trained(optimizer, 1), _trained(optimizer, 0)
    tree = {**TrainingComponents(model=other.model, optimizer=other.optimizer).capture(),
            "rng": capture_rng(), "data": other.data.state_dict()}
    borrowed = frozenset()
    if stored == "views":
        tree, borrowed = _as_views(tree)

    class Refusing:
        def state_dict(self):
            return w.data.state_dict()

        def load_state_dict(self, state):
            if fails == "data" and state != w.data.state_dict():  # (its own, put back, it takes)
                raise RuntimeError("this loader cannot take it")

    def refuse(module, incompatible):
        if not torch.equal(module.weight, last_weight):  # (its own, put back, it takes)
            raise RuntimeError("this loader cannot take it")

    last = [m for m in w.model.modules() if isinstance(m, torch.nn.Linear)][-1]
    last_weight = last.weight.detach().clone()
    hook = last.register_load_state_dict_post_hook(refuse) if fails == "model" else None

    def live() -> str:
        return state_hash({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()})

    before, loaded = live(), state_hash({"model": other.model.state_dict(), "optimizer": other.optimizer.state_dict()})
    assert before != loaded
    torch.manual_seed(123)  # (the RNG the checkpoint holds is another: restore must put this one back)
    rng = state_hash(capture_rng())
    with pytest.raises(StateMismatchError, match="this loader cannot take it.*as they were"):
        TrainingComponents(model=w.model, optimizer=w.optimizer, data=Refusing()).restore(tree, borrowed=borrowed)
    assert live() == before and state_hash(capture_rng()) == rng
    if hook is not None:
        hook.remove()
    TrainingComponents(model=w.model, optimizer=w.optimizer, data=w.data).restore({**tree, "data": w.data.state_dict()})
    assert live() == loaded


@pytest.mark.parametrize("optimizer", ["adamw", "in_backward"])
def test_a_stored_view_goes_into_the_optimizers_own_tensor_and_is_never_kept(optimizer):
    """Optimizer state stored as views into a larger buffer (a region's slot), borrowed: where the
    live optimizer holds its state, each view is loaded into the live tensor of its parameter and
    name (the optimizer keeps its tensors, now the stored values); where it has none yet, each is
    copied into memory of its own — the optimizer never keeps a borrowed view. Views not borrowed
    (what a checkpoint agent hands over) it keeps as they are."""
    from everystep.state import TrainingComponents, owns_memory

    other = _trained(optimizer, 1)
    tree, borrowed = _as_views({**TrainingComponents(model=other.model, optimizer=other.optimizer).capture(),
                                "rng": capture_rng()})
    expected = state_hash({"model": other.model.state_dict(), "optimizer": other.optimizer.state_dict()})
    for steps in (1, 0):  # (an optimizer that holds its state; one that has none yet)
        w = _trained(optimizer, 0, steps)
        held = {id(t) for entry in w.optimizer.state.values() for t in entry.values()}
        TrainingComponents(model=w.model, optimizer=w.optimizer).restore(tree, borrowed=borrowed)
        assert state_hash({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()}) == expected
        now = [t for entry in w.optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
        assert now and all(owns_memory(t) for t in now)
        assert {id(t) for t in now} == held if steps else not held
    w = _trained(optimizer, 0, 1)
    TrainingComponents(model=w.model, optimizer=w.optimizer).restore(tree)  # (nothing borrowed)
    assert not any(owns_memory(t) for entry in w.optimizer.state.values() for t in entry.values())


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
def test_host_state_goes_into_the_tensors_a_live_optimizer_holds_on_another_device():
    """A live optimizer whose state lies on a device (the meta device here, which holds no data;
    a GPU in test_cuda.py, which checks the values): the stored state, on the host, is copied into
    the tensors it holds there — it keeps them, on its device — where torch's load would have put
    new ones in their place. A step counter, which torch keeps on the host, is loaded as before."""
    from everystep.state import TrainingComponents

    def made(device):
        model = torch.nn.Linear(3, 4, device=device)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 3, device=device)).sum().backward()
        optimizer.step()
        return model, optimizer

    trained, by = made("cpu")
    tree = {**TrainingComponents(model=trained, optimizer=by).capture(), "rng": capture_rng()}
    model, optimizer = made("meta")
    held = {(i, name): t for i, entry in enumerate(optimizer.state.values()) for name, t in entry.items()}
    TrainingComponents(model=model, optimizer=optimizer).restore(tree)
    now = {(i, name): t for i, entry in enumerate(optimizer.state.values()) for name, t in entry.items()}
    assert now.keys() == held.keys() and len(now) == 6
    for (i, name), t in now.items():
        assert (t is held[i, name]) == (name != "step"), (i, name)
        assert t.device.type == ("cpu" if name == "step" else "meta")
