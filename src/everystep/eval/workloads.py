"""The deterministic workloads of the measurement protocol.

===============  ======================================================  ==========
name             model                                                   batch
===============  ======================================================  ==========
``mlp``          3-layer MLP classifier with dropout, 32 → 10 classes    16
``gpt2-tiny``    GPT-2 (2 layers, width 64, vocab 256, seq 32)           4
``gpt2-small``   GPT-2 (6 layers, width 512, vocab 8192, seq 128), ~23M  8
``gpt2-medium``  GPT-2 (24 layers, width 1024, vocab 32768, seq 256),    8
                 ~336M: about 4 TFLOP a step, for a GPU-bound step as
                 training's are (gpt2-small's is bound by kernel launches)
``resnet``       ResNet-style CNN with BatchNorm, 3×32×32 → 10 classes   16
===============  ======================================================  ==========

GPT-2 models tie the token embedding and the output projection, and use dropout, so shared
parameters and the random generator's state are exercised by every checkpoint.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..compress import GradientCompression, ddp_compression, make_compressor, parse_spec
from ..errors import ConfigError
from ..optim import OptimizerInBackward
from .data import SyntheticData

__all__ = ["Workload", "WORKLOADS", "OPTIMIZERS", "build", "state_bytes", "needs_ddp", "check_device", "resolve_device", "GPT",
           "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq: int
    layers: int
    width: int
    heads: int
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.dropout = c.dropout
        self.ln1 = nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.ln2 = nn.LayerNorm(c.width)
        self.mlp = nn.Sequential(nn.Linear(c.width, 4 * c.width), nn.GELU(), nn.Linear(4 * c.width, c.width))
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, w)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A GPT-2-style decoder whose output projection shares the token embedding's weight."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.width)
        self.wpe = nn.Embedding(c.seq, c.width)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.width)
        self.lm_head = nn.Linear(c.width, c.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.layers) if name.endswith("proj.weight") else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


def resnet(classes: int = 10, widths: tuple[int, ...] = (32, 64, 128)) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    cin = widths[0]
    for i, w in enumerate(widths):
        layers += [ResidualBlock(cin, w, 1 if i == 0 else 2), ResidualBlock(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


@dataclass
class Workload:
    """A model, its optimizer and schedule, resumable data, and how to compute a batch's loss."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: SyntheticData
    criterion: Callable[[nn.Module, Any], torch.Tensor]
    compression: Any = None
    """The gradient compression training uses (``build(compress=…)``), or None."""
    device: torch.device = torch.device("cpu")
    """Where the model, its optimizer state and each batch live."""

    def loss(self, batch: Any) -> torch.Tensor:
        """The loss of ``batch`` (made on the CPU, moved to :attr:`device`) through ``model`` (the
        DistributedDataParallel wrapper, when there is one)."""
        if self.device.type != "cpu":
            batch = tuple(t.to(self.device) for t in batch) if isinstance(batch, tuple) else batch.to(self.device)
        return self.criterion(self.model, batch)

    @property
    def in_backward(self) -> bool:
        """Whether the optimizer updates each layer during backward (no ``optimizer.step()``)."""
        return isinstance(self.optimizer, OptimizerInBackward)

    def update(self, *, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
        """After ``loss.backward()``: clip the gradients and step the optimizer (``before`` runs right
        before the step, ``after`` right after it), then clear the gradients and step the schedule.
        With updates in backward the backward pass has already updated, and cleared the gradients
        (clipping needs every gradient before any update, so there is none)."""
        if not self.in_backward:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            if before is not None:
                before()
            self.optimizer.step()
        if after is not None:
            after()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()


def _token_sample(vocab: int, seq: int) -> Callable[[torch.Generator], torch.Tensor]:
    def make(g: torch.Generator) -> torch.Tensor:
        # A noisy affine walk over the vocabulary: learnable, yet not trivial.
        start = torch.randint(vocab, (1,), generator=g)
        noise = (torch.rand(seq + 1, generator=g) < 0.1) * torch.randint(vocab, (seq + 1,), generator=g)
        steps = torch.arange(seq + 1) * 7
        return (start + steps + noise) % vocab

    return make


def _gpt(c: GPTConfig, batch: int) -> tuple[nn.Module, Any, int, Callable[[nn.Module, Any], torch.Tensor]]:
    def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, c.vocab), tokens[:, 1:].reshape(-1))

    return GPT(c), _token_sample(c.vocab, c.seq), batch, loss


def _classify(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = b
    return F.cross_entropy(model(x), y)


def _classifier(model: nn.Module, make: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]], batch: int):
    return model, make, batch, _classify


def _mlp(seed: int):
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(seed + 17))

    def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, generator=g)
        return x, (x @ teacher).argmax()

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return _classifier(model, make, 16)


def _resnet(seed: int):
    def make(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(10, (), generator=g)
        x = torch.randn(3, 32, 32, generator=g) * 0.5
        x[y % 3, :, :] += (y.float() - 4.5) / 4.5  # a class signal in one channel
        return x, y

    return _classifier(resnet(), make, 16)


WORKLOADS: dict[str, Callable[[int], Any]] = {
    "mlp": _mlp,
    "gpt2-tiny": lambda seed: _gpt(GPTConfig(vocab=256, seq=32, layers=2, width=64, heads=4), 4),
    "gpt2-small": lambda seed: _gpt(GPTConfig(vocab=8192, seq=128, layers=6, width=512, heads=8), 8),
    "gpt2-medium": lambda seed: _gpt(GPTConfig(vocab=32768, seq=256, layers=24, width=1024, heads=16), 8),
    "resnet": _resnet,
}

_OPTIMIZER_CLASSES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {}),
    "momentum": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-4}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.01}),
}

OPTIMIZERS: dict[str, Callable[[Any, float], torch.optim.Optimizer]] = {
    name: (lambda params, lr, cls=cls, kw=kw: cls(params, lr=lr, **kw)) for name, (cls, kw) in _OPTIMIZER_CLASSES.items()
}

_DEFAULT_LR = {"sgd": 0.05, "momentum": 0.02, "adam": 1e-3, "adamw": 1e-3}


class WarmupCosine:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to 10% at ``total``."""

    def __init__(self, warmup: int = 10, total: int = 1000) -> None:
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def check_device(name: str, ranks: int = 1) -> None:
    """A clear error where ``name`` is not a device this machine can train ``ranks`` ranks on."""
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda needs a GPU, and torch sees none here")
    if name == "cuda" and torch.cuda.device_count() < ranks:
        raise ConfigError(f"--device cuda gives each rank a GPU of its own: {ranks} ranks need {ranks} GPUs, "
                          f"torch sees {torch.cuda.device_count()}")


def resolve_device(name: str, *, rank: int = 0, world: int = 1) -> torch.device:
    """The device ``name`` (``cpu`` or ``cuda``) names for ``rank``: under ``cuda`` each rank has a
    GPU of its own (``cuda:<LOCAL_RANK>``). A clear error where the machine has no such device.

    On CUDA, training is made deterministic (``torch.use_deterministic_algorithms``), as bit-exact
    recovery needs: a run and its recovered continuation must compute the same bits.
    """
    check_device(name, world)
    if name == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


LAYOUT_OF: dict[str, str | None] = {"ddp": None, "fsdp": "FSDP2", "hsdp": "HSDP", "zero1": "ZeRO-1"}
"""How a workload's ranks hold its state, by ``parallel``: DistributedDataParallel replicas, FSDP2
shards, HSDP (two replicas, each sharded over half the ranks), or ZeRO-1 (DDP replicas whose
optimizer state is partitioned over the ranks by a ZeroRedundancyOptimizer); the sharded layout it
is (:data:`everystep.parallelism.LAYOUTS`), None for replicas."""

PARALLEL = tuple(LAYOUT_OF)


def fully_shard_model(model: nn.Module, device_type: str, *, hsdp: bool = False) -> nn.Module:
    """``model`` sharded with FSDP2 over every rank (``fully_shard``: each block of a ModuleList a unit
    of its own, the rest in the root's), as TorchTitan shards its transformer's blocks; ``hsdp``: over a
    2-D mesh, replicated across its first dimension (2) and sharded across its second (half the ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torch.distributed as dist

    world = dist.get_world_size()
    if hsdp and (world < 2 or world % 2):
        raise ConfigError(f"parallel='hsdp' keeps two replicas, each sharded over half the ranks: it needs an even "
                          f"number of ranks, got {world}")
    mesh = init_device_mesh(device_type, (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else \
        init_device_mesh(device_type, (world,))
    for child in model.children():
        if isinstance(child, nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build(name: str, *, seed: int = 0, optimizer: str = "adamw", lr: float | None = None, rank: int = 0,
          world: int = 1, compress: str | None = None, bucket_cap_mb: float | None = None,
          device: str = "cpu", in_backward: bool = False, batch: int | None = None, parallel: str = "ddp") -> Workload:
    """Build a workload deterministically from ``seed``: same seed, same bits.

    With ``world`` > 1 (torch.distributed initialised), the model is wrapped in
    DistributedDataParallel and each rank draws its own part of every global batch. ``compress``
    (``topk:0.01``, ``quant8``, ``powersgd:rank=4``) sets up gradient compression: in one process
    through the optimizer, under DDP in its communication hook. PowerSGD always runs in DDP's
    hook, so it wraps the model in a world of one process as well (the group must exist:
    :func:`everystep.distributed.init_process_group` with ``one_process=True``). ``bucket_cap_mb``
    sets DDP's gradient bucket size (default PyTorch's); above two ranks DDP keeps its first buckets
    (``find_unused_parameters=True``), so that a restart sums gradients as the run did. ``device`` (``cpu`` or ``cuda``, see
    :func:`resolve_device`) holds the model and its optimizer state; data is made on the CPU.
    ``in_backward``: the optimizer is an :class:`~everystep.OptimizerInBackward` (each parameter
    updated during backward; under DDP once its bucket is all-reduced), with no compression.
    ``batch``: samples per step and rank (default: the workload's own). ``parallel`` ``"fsdp"``: the
    model is sharded with FSDP2 over the ranks (:func:`fully_shard_model`; torch.distributed
    initialised, one process or several) instead of replicated by DistributedDataParallel; ``"hsdp"``:
    HSDP, two replicas each sharded over half the ranks; ``"zero1"``: DistributedDataParallel with a
    ZeroRedundancyOptimizer (each rank updates, and holds the state of, its partition of the parameters).
    """
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if in_backward and compress is not None:
        raise ConfigError(f"in_backward=True takes no gradient compression; got compress={compress!r}")
    if parallel not in PARALLEL:
        raise ConfigError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    if parallel != "ddp" and (compress is not None or in_backward):
        raise ConfigError(f"parallel={parallel!r} takes no gradient compression and no updates in backward (each is "
                          "built on a DistributedDataParallel replica's whole gradients and optimizer)")
    where = resolve_device(device, rank=rank, world=world)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    if batch is not None and batch < 1:
        raise ConfigError(f"batch must be at least 1, got {batch}")
    model, make_sample, default_batch, criterion = WORKLOADS[name](seed)
    batch = batch or default_batch
    model.to(where)
    data = SyntheticData(make_sample, size=4096, batch_size=batch, seed=seed, rank=rank, world=world)
    rate = lr if lr is not None else _DEFAULT_LR[optimizer]
    wrapped = parallel == "zero1" or (parallel == "ddp" and (world > 1 or needs_ddp(compress)))
    if parallel in ("fsdp", "hsdp"):
        model = fully_shard_model(model, where.type, hsdp=parallel == "hsdp")
    elif wrapped:
        kw: dict[str, Any] = {"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb else {}
        if world > 2:  # keep the first buckets: a restart then sums as the run did (see restart_rounding)
            kw["find_unused_parameters"] = True
        if where.type == "cuda":
            kw["device_ids"] = [where.index]
        model = nn.parallel.DistributedDataParallel(model, **kw)
    if in_backward:
        opt: torch.optim.Optimizer = OptimizerInBackward(
            model.parameters(), lambda group: OPTIMIZERS[optimizer](group, rate), ddp=model if wrapped else None)
    elif parallel == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kw = _OPTIMIZER_CLASSES[optimizer]
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, lr=rate, **kw)
    else:
        opt = OPTIMIZERS[optimizer](model.parameters(), rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine())
    compression = None
    if compress is not None:
        compression = ddp_compression(compress, model, opt) if wrapped else \
            GradientCompression(make_compressor(compress), model, opt)
    return Workload(name=name, model=model, optimizer=opt, scheduler=scheduler, data=data, criterion=criterion,
                    compression=compression, device=where)


def needs_ddp(compress: str | None) -> bool:
    """Whether compression ``compress`` runs in a DDP communication hook even in one process."""
    return compress is not None and parse_spec(compress)[0] == "powersgd"


def state_bytes(name: str) -> int:
    """The bytes of the workload's model and AdamW optimizer state after a step (what a full
    checkpoint of it holds, less the small rest)."""
    w = build(name)
    w.loss(w.data.next()).backward()
    w.update()
    tensors = [*w.model.state_dict().values(), *(v for s in w.optimizer.state.values() for v in s.values())]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
