"""How much of the GPU a colocated vLLM engine may claim, given what is already resident.

vLLM refuses to start unless ``free >= gpu_memory_utilization x total`` (its pool is sized as a
fraction of the *whole* device, not of what is free), so with trainer shards resident the
requested fraction can be impossible. Checked before the engine is built, from
``torch.cuda.mem_get_info()``, so the job fails in one line instead of inside vLLM.
"""

from __future__ import annotations

from fsdp_rlhf.errors import UserError

GIB = 2**30
# Left free beside vLLM's pool: its start-up profiling, the weight-sync gather buckets and
# allocator fragmentation need some slack (ASSUMED, not yet measured on a GPU).
MARGIN_BYTES = 1 * GIB


def vllm_memory_utilization(
    free: int, total: int, requested: float, margin: int = MARGIN_BYTES
) -> tuple[float, str]:
    """The ``gpu_memory_utilization`` to pass to vLLM, and a log line saying why.

    Returns ``requested`` when ``requested x total + margin <= free``; raises a UserError naming
    ``--vllm_gpu_memory_utilization``, the numbers and the largest value that would start
    otherwise. The requested fraction is never raised behind the user's back: it sizes the KV
    cache the user asked for, and lowering it silently would change throughput unannounced.
    """
    if total <= 0 or not 0 < requested <= 1:
        raise UserError(f"--vllm_gpu_memory_utilization {requested}: must be in (0, 1]")
    free = min(free, total)
    need = requested * total
    fits_max = max(0.0, (free - margin) / total)
    numbers = (
        f"{free / GIB:.1f} GiB free of {total / GIB:.1f} GiB, {requested:g} x total = "
        f"{need / GIB:.1f} GiB + {margin / GIB:.1f} GiB margin"
    )
    if need + margin > free:
        resident = (total - free) / GIB
        raise UserError(
            f"--vllm_gpu_memory_utilization {requested:g} cannot start vLLM: {numbers} "
            f"({resident:.1f} GiB already resident). Use at most {int(fits_max * 100) / 100:.2f}, "
            "or build/sleep the engine before the models load, or --adam_offload / "
            "--ref_reward_offload"
        )
    return requested, f"vLLM memory: {numbers}: fits"


def check_device_budget(device, requested: float) -> str:
    """:func:`vllm_memory_utilization` on what ``device`` (CUDA) has free now; the log line."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return vllm_memory_utilization(free, total, requested)[1]
