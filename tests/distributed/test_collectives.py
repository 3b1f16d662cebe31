"""Every tensor collective of the package on a group without a host backend (issue #36).

NCCL registers CUDA alone: ``init_process_group("cuda:gloo")`` builds a group that, like NCCL,
maps only CUDA to a backend, so a host tensor handed to it fails with "No backend type
associated with device type cpu" (what `sft` hit on NCCL: host masks into the token count).
On a machine without CUDA nothing can be reduced on such a group; what the test checks there is
that each helper hands the group a CUDA tensor (torch then says CUDA is missing) instead of a
host one. With CUDA the same calls run and their values are checked.
"""

from __future__ import annotations

import torch

from tests.dist_utils import run_distributed

NO_HOST_BACKEND = "No backend type associated with device type cpu"


def _helpers(rank: int):
    """(name, call) for every helper of the package that all-reduces a tensor it may get on
    the host, each with host inputs."""
    from fsdp_rlhf.distributed import stats
    from fsdp_rlhf.distributed.env import all_reduce_scalars, run_and_agree
    from fsdp_rlhf.distributed.fsdp import clip_grad_norm_
    from fsdp_rlhf.trainers.micro_batches import MicroBatching

    mask = torch.ones(2, 3, dtype=torch.bool)
    values = torch.full((2, 3), float(rank + 1))
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), float(rank + 1))
    batching = MicroBatching(1, max_tokens=8, packed=True)
    lengths = torch.tensor([4, 4, 4][: rank + 2])
    return [
        ("global_token_count", lambda: stats.global_token_count([mask, mask[:1]])),
        ("global_masked_mean", lambda: float(stats.global_masked_mean(values, mask))),
        ("global_masked_var", lambda: float(stats.global_masked_var(values, mask))),
        ("global_masked_whiten", lambda: stats.global_masked_whiten(values, mask).shape),
        ("all_reduce_scalars", lambda: all_reduce_scalars({"x": float(rank + 1)}, "sum")),
        ("run_and_agree", lambda: run_and_agree(lambda: rank, "probe")),
        ("clip_grad_norm_", lambda: clip_grad_norm_([param], 0.0)),
        ("MicroBatching.split", lambda: len(batching.split(lengths))),
    ]


def _call_each(rank: int, world: int):
    out = {}
    try:  # the one place that decides (absent before issue #36)
        from fsdp_rlhf.distributed.collectives import collective_device

        host = torch.device("cpu")
        out["collective_device"] = ("ok", [str(collective_device(prefer=host))])
    except ImportError as e:
        out["collective_device"] = ("ImportError", str(e))
    for name, call in _helpers(rank):
        try:
            out[name] = ("ok", call())
        except Exception as e:  # noqa: BLE001 - the error text is what is checked
            out[name] = (type(e).__name__, str(e).splitlines()[0])
    return out


def test_helpers_reduce_on_a_group_without_host_backend():
    results = run_distributed(_call_each, 2, backend="cuda:gloo")
    for r in results:
        for name, (status, detail) in r.items():
            if name == "collective_device":
                continue
            assert NO_HOST_BACKEND not in str(detail), (name, detail)
            if torch.cuda.is_available():
                assert status == "ok", (name, detail)
            else:  # handed a CUDA tensor on a machine without CUDA
                assert "CUDA" in str(detail) or "NVIDIA" in str(detail), (name, status, detail)
        device = r["collective_device"][1]
        assert device[0].startswith("cuda"), device  # even for a host tensor
    if torch.cuda.is_available():
        r = results[0]
        assert r["global_token_count"][1] == 2 * 9
        assert abs(r["global_masked_mean"][1] - 1.5) < 1e-6
        assert r["all_reduce_scalars"][1] == {"x": 3.0}
