"""everystep inside the trainers people use.

- :mod:`everystep.integrations.lightning` (``pip install everystep[lightning]``): a PyTorch Lightning
  ``Callback`` and a resumable sampler.
- :mod:`everystep.integrations.transformers` (``pip install everystep[transformers]``): a Hugging Face
  ``TrainerCallback`` and the ``Trainer`` subclass that resumes from it.

Each checkpoints with any everystep strategy, as often as every step, and resumes a killed run from
everystep's newest recoverable point, bit-exact on the CPU, with what the trainer's own checkpoint
leaves out (random generators, the data position). Importing this package imports neither trainer.
"""

from __future__ import annotations

from typing import Any

from ..errors import StateMismatchError

__all__ = ["Schedulers"]


class Schedulers:
    """Several LR schedulers as the one ``scheduler`` a :class:`~everystep.Checkpointer` takes."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["schedulers"]
        if len(saved) != len(self.schedulers):
            raise StateMismatchError(f"the checkpoint holds {len(saved)} LR schedulers; this run has "
                                     f"{len(self.schedulers)}")
        for scheduler, s in zip(self.schedulers, saved):
            scheduler.load_state_dict(s)


def one_scheduler(schedulers: list[Any]) -> Any:
    """``None``, the only scheduler, or :class:`Schedulers` of them all."""
    if not schedulers:
        return None
    return schedulers[0] if len(schedulers) == 1 else Schedulers(schedulers)
