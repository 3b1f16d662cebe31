"""Fault injection for the tests of lossless resume: a rank that kills itself, with SIGKILL as
the OOM killer or a lost node would, at a named point of its work.

``FSDP_RLHF_KILL_AT=<rank>:<phase>:<n>`` (``<rank>``: the rank in the whole job) makes that
rank SIGKILL itself when it reaches ``phase`` with number ``n`` (a batch, step or weight
version; the phase says which). Unset, :func:`reached` only reads one variable. The points:

    generating  a rollout rank, between two engine steps of batch n
    queued      a rollout rank, batch n sent and not yet trained, waiting for weights
    syncing     a rollout rank receiving weight version n, after its first bucket; a training
                rank publishing version n, after its first bucket
    training    a training rank in step n, before its updates

Not a setting: the tests set it (docs/testing.md).
"""

from __future__ import annotations

import os
import signal

ENV = "FSDP_RLHF_KILL_AT"


def _spec() -> tuple[int, str, int] | None:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    rank, phase, n = raw.split(":")
    return int(rank), phase, int(n)


def reached(phase: str, n: int) -> None:
    """This rank reached ``phase`` with number ``n``: dies here if the test said so (read
    when called, not when imported: a process forked after the import has its own)."""
    spec = _spec()
    if spec is None:
        return
    rank, want, at = spec
    if want == phase and at == n and int(os.environ.get("RANK", "-1")) == rank:
        os.kill(os.getpid(), signal.SIGKILL)
