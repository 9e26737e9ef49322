"""How an agent process starts: ``python -m everystep.agent`` (:func:`main`), or forked from a zygote
(:func:`forked`; see :attr:`~everystep.agent.client.AgentLink.launcher`)."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

from .. import tracing
from .channel import AgentAddress, open_log
from .config import AgentConfig
from .process import Agent

__all__ = ["main", "forked"]


def main(argv: list[str]) -> int:
    """``python -m everystep.agent CONFIG_JSON``, with the address in ``EVERYSTEP_AGENT``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process, which closes us
    # So is SIGTERM: a launcher restarting a training process signals its process group (torchrun
    # restarts every worker when a host is lost), and the agent outlives its training process by
    # design: it ends when one closes it, or ``grace`` seconds after the last one left.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = AgentConfig(**json.loads(argv[0]))
    address = AgentAddress(**json.loads(os.environ.pop("EVERYSTEP_AGENT")))
    torch.set_num_threads(config.threads)
    tracing.start_from_env("checkpoint agent")
    try:
        Agent(config, address).serve()
    except Exception as e:
        print(f"everystep agent: {e}", file=sys.stderr)
        return 1
    finally:
        tracing.stop()
    return 0


def forked(argv: list[str]) -> int:
    """An agent forked from a zygote: ``CWD LOG CONFIG_JSON``, in the working directory of the
    process that asked for it, its output appended to ``LOG`` — as a fresh interpreter's would be."""
    os.chdir(argv[0])
    fd = open_log(argv[1])
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return main(argv[2:])
