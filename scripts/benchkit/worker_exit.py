"""How the TRL workers end: once every rank has finished training, exit without interpreter
teardown.

Their step rows are on disk by then. The teardown itself sometimes aborts on this machine
("terminate called without an active exception", exit 134) after a run that completed, which
would fail a whole bench over a finished measurement. Imported by the worker scripts, which run
with the repository on ``PYTHONPATH`` (``launch.bench_env``).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def exit_after_training() -> None:
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
