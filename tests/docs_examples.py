"""Runs every Python example of the README and of ``docs/`` (but the trainers', which
``tests/test_integrations.py`` runs), each as written, in a process of its own (run as a script).

    python tests/docs_examples.py OUT_DIR

What an example leaves to the reader — ``MyModel``, ``MyResumableLoader``, ``model``, ``optimizer``,
``scheduler``, ``data``, ``total_steps`` and the like — is defined first, small; a job of one rank
(gloo, loopback) serves the examples that wrap the model in DistributedDataParallel. Each example
runs in a folder of its own under OUT_DIR; a path under ``/dev/shm/`` is moved into that folder.
Prints one JSON line: each example's name and ``null``, or the traceback of its failure.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(?:<!-- example: (?P<name>[a-z_]+) -->\n)?```python\n(?P<code>.*?)```", re.S)
TRAINERS = ("lightning", "transformers")
"""Examples named so are the trainers' (``tests/test_integrations.py``)."""

PRELUDE = '''
import signal, time
import torch
import torch.distributed as dist
import everystep
from torch.nn.parallel import DistributedDataParallel


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


class MyResumableLoader:
    def __init__(self):
        self.position = 0

    def next(self):
        self.position += 1
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(self.position))

    def __iter__(self):
        return self

    __next__ = next

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


torch.manual_seed(0)
model = DistributedDataParallel(MyModel()) if WANTS_DDP else MyModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
data = loader = sampler_position = MyResumableLoader()
batches = iter(data)
ddp_model = DistributedDataParallel(MyModel())
total_steps = total = 3
warmup = lambda step: min(1.0, (step + 1) / 10)
end_time = time.time() + 3600
'''


def examples() -> list[tuple[str, str]]:
    """(name, code) of every Python example: ``README.md:83`` (the file and the line of its fence)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in _BLOCK.finditer(text):
            if m["name"] in TRAINERS:
                continue
            line = text.count("\n", 0, m.start("code"))
            found.append((f"{path.relative_to(ROOT)}:{line}", m["code"]))
    return found


def main(out: Path) -> dict[str, str | None]:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    results: dict[str, str | None] = {}
    for i, (name, code) in enumerate(examples()):
        folder = out / f"example-{i}"
        folder.mkdir(parents=True)
        os.chdir(folder)
        code = code.replace("/dev/shm/", f"{folder}/shm-")
        namespace = {"__name__": f"example_{i}", "WANTS_DDP": "ddp=model" in code}
        try:
            exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
            exec(compile(code, name, "exec"), namespace)
            results[name] = None
        except BaseException:
            results[name] = traceback.format_exc()
        finally:
            os.chdir(out)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]).resolve())))
