"""Local multi-process launches for the demo, the bench and the tests."""

from __future__ import annotations

import sys

from fsdp_rlhf.distributed.env import free_port


def local_torchrun(nproc: int, target: list[str], port: int | None = None) -> list[str]:
    """Command line running TARGET (``-m module args`` or a script and its args) on ``nproc``
    local ranks under torchrun, on ``port`` or a free one."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port if port is not None else free_port()),
        *target,
    ]
