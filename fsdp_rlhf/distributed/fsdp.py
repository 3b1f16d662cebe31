"""FSDP2 (``fully_shard``) wrapping, gradient clipping on DTensors, and full-state-dict gathers."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_rlhf.config import FSDPConfig
from fsdp_rlhf.distributed.collectives import all_reduce, collective_device
from fsdp_rlhf.distributed.expert_parallel import (
    ExpertParallel,
    distribute_experts,
    routed_experts,
)
from fsdp_rlhf.distributed.gloo_comm import all_gather_into, use_p2p_reduce_scatter
from fsdp_rlhf.distributed.vision_units import tower_in_every_forward, vision_tower

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF model, found by the model's own ``_no_split_modules``:
    the units FSDP shards one by one (and ``models.compile`` compiles part by part)."""
    names: set[str] = set()
    for m in model.modules():
        if isinstance(m, nn.Module) and getattr(type(m), "_no_split_modules", None):
            names.update(type(m)._no_split_modules)
    return [m for m in model.modules() if type(m).__name__ in names]


def build_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    """A 1-D data-parallel mesh over all ranks (FSDP shards over it)."""
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))


def reshard_after_forward(zero_stage: int, frozen: bool = False) -> bool:
    """ZeRO-3 frees gathered params after forward (re-gathers in backward); lower stages keep
    them until backward ends, trading memory for one all-gather per layer. A frozen model never
    runs backward, so keeping its gathered params would only pin a full copy: always reshard."""
    return frozen or zero_stage >= 3


def describe_zero_stage(zero_stage: int) -> str:
    if zero_stage >= 3:
        return "zero_stage=3 -> FSDP2 fully_shard(reshard_after_forward=True)"
    return (
        f"zero_stage={zero_stage} -> FSDP2 fully_shard(reshard_after_forward=False): params stay "
        "gathered from forward until backward ends; grads and optimizer states are sharded"
    )


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    fsdp: FSDPConfig,
    *,
    bf16: bool,
    grad_reduce: Literal["mean", "sum"] = "mean",
    cpu_offload: bool = False,
    frozen: bool = False,
    dp_size: int | None = None,
    ep: ExpertParallel | None = None,
    layer_input_casts: bool = False,
) -> nn.Module:
    """Apply ``fully_shard`` to each decoder layer (a VLM's vision blocks included), to a
    VLM's vision tower as a whole (patch embedding and projector: its own unit, gathered only
    when images go through it), then to the root.

    The model may arrive on CPU: ``fully_shard`` moves one layer's params to the mesh device,
    shards them and drops the full copy before the next layer, so the whole unsharded model never
    sits on the GPU (only the host must hold it once, at load).

    Args:
        grad_reduce: ``"mean"`` lets FSDP average gradients over ranks; ``"sum"`` leaves them
            summed, for losses normalised by a global token count computed by the caller.
        cpu_offload: keep sharded params, grads and optimizer states on CPU (GPU only); such a
            model is marked so that the phase offload/onload in ``offload`` leaves it alone.
        frozen: never trained (ref, reward): params are resharded after every forward.
        dp_size: ranks holding different data, when fewer than the mesh's (sequence
            parallelism: a group's ranks compute parts of one micro-batch's gradient, summed
            over the world); ``"mean"`` then divides the sum by it, not by the world size.
        ep: expert parallelism (``distributed.expert_parallel``): each MoE layer's routed
            experts are split over its groups and sharded over the ranks holding the same
            experts, as their own FSDP2 units inside the layers.
        layer_input_casts: FSDP2 casts each decoder layer's floating inputs to the compute
            dtype (``cast_forward_inputs``, its default; the GPU ladder's baseline). Off, the
            layers take the previous layer's output as it is, already in that dtype.
    """
    compute = _compute_dtype(model, bf16)
    kwargs, layer_kwargs = _unit_kwargs(mesh, fsdp, compute, frozen, layer_input_casts)
    if uses_cpu_offload_policy(cpu_offload, mesh.device_type):
        kwargs["offload_policy"] = layer_kwargs["offload_policy"] = CPUOffloadPolicy(
            pin_memory=True
        )
        model._fsdp_rlhf_cpu_offload = True
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard")
    experts = _shard_experts(model, ep, kwargs)
    tower = vision_tower(model)
    in_tower = set(tower.modules()) if tower is not None else set()
    for layer in layers:  # a VLM's vision blocks keep the casts (fp32 rotary inputs)
        fully_shard(layer, **(kwargs if layer in in_tower else layer_kwargs))
    units = [*experts, *layers, *([tower] if tower is not None else [])]
    if tower is not None:
        fully_shard(tower, **kwargs)
        tower_in_every_forward(model)  # ranks without images still gather the tower
    # The root (embeddings, final norm, output layer) keeps its params from forward to
    # backward when a backward follows: its backward starts right after its forward ends, and
    # at ZeRO-3 it would gather them again at once (the memory model counts the root gathered
    # through the whole update).
    fully_shard(model, **{**kwargs, "reshard_after_forward": frozen})
    if kwargs.get("offload_policy") is not None:
        for p in model.parameters():  # the optimizer only sees params: mark them too
            p._fsdp_rlhf_cpu_offload = True
    for m in [*units, model]:
        # Registered after fully_shard, so it runs after FSDP's own post-forward hook.
        m.register_forward_hook(_reshard_if_no_grad)
    _set_reduction(model, mesh, grad_reduce, dp_size, experts, ep)
    if dist.get_backend(mesh.get_group()) == "gloo":
        use_p2p_reduce_scatter(model)
    return model


def _compute_dtype(model: nn.Module, bf16: bool) -> torch.dtype:
    """bf16, else float32; a float64 model (a test's exact reference) stays in float64, its
    gradients reduced in float64."""
    if bf16:
        return torch.bfloat16
    wide = any(p.dtype == torch.float64 for p in model.parameters())
    return torch.float64 if wide else torch.float32


def _unit_kwargs(
    mesh: DeviceMesh,
    fsdp: FSDPConfig,
    compute: torch.dtype,
    frozen: bool,
    layer_input_casts: bool,
) -> tuple[dict, dict]:
    """``fully_shard``'s arguments for the root and a vision tower, and for decoder layers.

    Decoder layers take the previous layer's output, already in the compute dtype: no
    per-layer cast of their inputs (torchtitan's setting). The root and a vision tower keep
    the casts (pixel values arrive in fp32)."""
    reduce_dtype = torch.promote_types(compute, torch.float32)
    kwargs = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce_dtype),
        reshard_after_forward=reshard_after_forward(fsdp.zero_stage, frozen),
    )
    layer_mp = MixedPrecisionPolicy(
        param_dtype=compute, reduce_dtype=reduce_dtype, cast_forward_inputs=layer_input_casts
    )
    return kwargs, dict(kwargs, mp_policy=layer_mp)


def _set_reduction(
    model: nn.Module,
    mesh: DeviceMesh,
    grad_reduce: Literal["mean", "sum"],
    dp_size: int | None,
    experts: list[nn.Module],
    ep: ExpertParallel | None,
) -> None:
    """How the units reduce their gradients (see :func:`shard_model`'s ``grad_reduce``)."""
    if grad_reduce == "sum":
        set_sum_reduction(model)
    elif (dp_size is not None and dp_size != mesh.size()) or experts:
        # expert units reduce over efsdp (W / E ranks) but average over the data ranks too
        set_sum_reduction(model, divide_by=dp_size or mesh.size())
    if experts and ep.mesh["efsdp"].size() == 1:
        # E == W: one rank per expert shard. torch 2.13's FSDP2 divides a one-rank unit's
        # gradient by the divide factor and, under forced sum reduction, once more after it;
        # without the forcing (nothing to communicate, so gloo's missing PREMUL_SUM is moot)
        # it divides once.
        for m in experts:
            m.set_force_sum_reduction_for_comms(False)


def _shard_experts(model: nn.Module, ep: ExpertParallel | None, kwargs: dict) -> list[nn.Module]:
    """Under expert parallelism: split every fused experts module over ``ep`` and make it an
    FSDP2 unit over the ranks holding the same experts; returns those units (none for a dense
    model, which shards as without expert parallelism)."""
    units = routed_experts(model) if ep is not None and ep.enabled else []
    for module in units:
        distribute_experts(module, ep)
        fully_shard(module, **{**kwargs, "mesh": ep.mesh["efsdp"]})
    return units


def uses_cpu_offload_policy(adam_offload: bool, device_type: str) -> bool:
    """``--adam_offload`` hands params, grads and Adam state to FSDP2's CPUOffloadPolicy.

    One mechanism per model: FSDP then owns where that model's state lives (CPU, copied to the
    GPU one layer at a time for compute) and the trainer's phase offload/onload of the model and
    its optimizer is a no-op for it. The reverse (phase offload only) would still hold the full
    Adam state on the GPU during every update, which is what ``--adam_offload`` exists to avoid.
    On a CPU job everything is host memory already, so no policy is applied.
    """
    return adam_offload and device_type == "cuda"


def is_cpu_offloaded(module: nn.Module) -> bool:
    """True when FSDP2's CPUOffloadPolicy manages ``module`` (see ``uses_cpu_offload_policy``)."""
    return bool(getattr(module, "_fsdp_rlhf_cpu_offload", False))


def _reshard_if_no_grad(module: nn.Module, args, output):
    """Free the gathered params after a forward under ``no_grad`` (scoring, values, old
    log-probs): no backward will need them, and below ZeRO-3 (and always for the FSDP root)
    FSDP2 would otherwise keep a full copy resident until the next backward."""
    if not torch.is_grad_enabled() and isinstance(module, FSDPModule):
        module.reshard()
    return output


def gradient_sync_every_micro_batch(zero_stage: int, gathered: bool = False) -> bool:
    """ZeRO-3 reduce-scatters after every micro-batch so gradients accumulate in sharded form
    (1/world of the fp32 grads resident); below ZeRO-3, and at ZeRO-3 with ``gathered``
    (``--accumulate_gathered``), the unsharded grads accumulate locally and are reduced once,
    after the last micro-batch (fewer collectives, more memory)."""
    return zero_stage >= 3 and not gathered


def accumulate(model: FSDPModule, last: bool, zero_stage: int, gathered: bool = False) -> None:
    """Call before each micro-batch's forward/backward of one optimizer step.

    Below ZeRO-3, gradients are reduce-scattered only after the last micro-batch and the
    gathered parameters also stay until then: FSDP2 otherwise frees them after every backward
    and gathers them again for the next micro-batch's forward, one all-gather of the whole model
    per micro-batch (2 CPU ranks over gloo, 4 micro-batches: 10% of the PPO update's time).
    At ZeRO-3 every micro-batch gathers each layer twice (forward and backward) and
    reduce-scatters it, unless ``gathered`` (``--accumulate_gathered``, chosen by the memory
    model: :func:`resolve_accumulate_gathered`): then each layer is gathered once per
    optimizer step and kept, with its unsharded gradients, until the last backward, as
    torchtitan accumulates: one all-gather and one reduce-scatter per layer per step.
    """
    if gradient_sync_every_micro_batch(zero_stage, gathered):
        model.set_requires_gradient_sync(True)
        return
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)
    if zero_stage >= 3:  # the root already keeps its params from forward to backward
        model.set_reshard_after_forward(False)


def resolve_accumulate_gathered(setting: str, zero_stage: int, device_type: str, fits) -> bool:
    """``--accumulate_gathered`` as a decision: ``on``/``off`` as asked; ``auto`` on at ZeRO-3
    on CUDA when ``fits()`` (the memory model: the update with every layer gathered and the
    gradients unsharded, as below ZeRO-3), off on CPU (where memory, not launches, is what
    ZeRO-3 is chosen for). Below ZeRO-3 accumulation is gathered anyway (returns False: nothing
    to change)."""
    if zero_stage < 3 or setting == "off":
        return False
    if setting == "on":
        return True
    return device_type == "cuda" and bool(fits())


def set_sum_reduction(model: nn.Module, divide_by: float = 1.0) -> None:
    """Make FSDP sum gradients across ranks instead of averaging them, then divide the sum by
    ``divide_by`` (1: a plain sum).

    NOTE: gloo has no PREMUL_SUM, so a divide factor alone fails there; forcing plain SUM
    reduction for the collectives is required too (FSDP then divides after the reduction).
    """
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(float(divide_by))
            m.set_force_sum_reduction_for_comms(True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[nn.Parameter], max_norm: float, group: dist.ProcessGroup | None = None
) -> float:
    """Total L2 norm of all (sharded) gradients across ranks; scales them to ``max_norm``.

    Works on the local shards of DTensors: each device's gradients (one group per device and
    dtype) give their norms in one ``_foreach_norm`` kernel, the squares are summed on the
    group's device and all-reduced once, and the host reads the total once (the step's one
    sync: the clipping decision and the returned value need it); the scaling is one
    ``_foreach_mul_`` per group. No full gradient is ever gathered. Grads may live on CPU
    (``--adam_offload``: FSDP's CPUOffloadPolicy) while the group is NCCL: the norms are taken
    where the shards live, only the squares travel to the group's device, and grads are
    scaled in place where they live.
    Returns the norm before clipping; ``max_norm <= 0`` only measures.
    """
    groups = _by_device_and_dtype([_local(p.grad) for p in params if p.grad is not None])
    # Also on one rank: a 1-rank all-reduce costs nothing and keeps the device path exercised.
    device = collective_device(group)
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in groups:
        sq += torch.stack(_foreach_norms(grads)).square().sum().to(device)
    sq = all_reduce(sq, dist.ReduceOp.SUM, group)
    total = math.sqrt(float(sq))
    if max_norm > 0 and total > max_norm and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        for grads in groups:
            torch._foreach_mul_(grads, coef)
    return total


def _foreach_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm in float32, one kernel for the list."""
    try:
        return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
    except TypeError:  # a torch whose _foreach_norm takes no dtype
        return [n.float() for n in torch._foreach_norm(grads, 2)]


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` (detached) in lists of one device and dtype each: what a foreach kernel
    takes."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t.detach())
    return list(groups.values())


# Most bytes one gather moves (full tensors, summed over the bucket); a larger parameter goes
# alone. One collective per parameter costs a latency each (hundreds of them for a 7B model),
# and casting shards to the target dtype before gathering halves the bytes when fp32 shards
# feed a bf16 engine: together much faster than per-parameter gathers. Over gloo, buckets of a
# few MB to tens of MB beat 256 MB ones (the big copies in and out of the buffer stop
# overlapping with the transfer; timings in benchmarks/). The CUDA size follows verl/OpenRLHF
# practice for NCCL (not measured here: no GPU).
GATHER_BUCKET_BYTES = {"cpu": 16 << 20, "cuda": 256 << 20}


def gather_bucket_bytes(model: nn.Module) -> int:
    """``GATHER_BUCKET_BYTES`` of the device the gathers run on: the mesh's (compute) device,
    not where the shards live. Under ``--adam_offload`` (CPUOffloadPolicy) the shards are on
    the host while the NCCL gathers run on the GPU: host-sized buckets there would cost about a
    thousand all-gathers for a 7B model instead of a few dozen."""
    p = next(model.parameters())
    device_type = p.device_mesh.device_type if isinstance(p, DTensor) else p.device.type
    return GATHER_BUCKET_BYTES.get(device_type, GATHER_BUCKET_BYTES["cuda"])


def _row_spans(p: torch.Tensor) -> list[tuple[int, int]] | None:
    """Rows ``[start, stop)`` of dim 0 that each rank of ``p``'s mesh holds (the mesh's ranks
    in flattened order) when ``p`` is an FSDP2 shard: ``Shard(0)`` on a 1-D mesh, or an expert
    tensor of expert parallelism, ``(_StridedShard(0), Shard(0))`` on the 2-D ``(efsdp, ep)``
    mesh (expert group slice j, then FSDP2's chunk f of it); else None.

    FSDP2 cuts rows into chunks of ``ceil(rows / ranks)`` (the last ranks shorter or empty):
    the DTensor contract, so every rank reaches the same answer without communicating.
    """
    if not isinstance(p, DTensor) or p.ndim == 0 or p.shape[0] == 0:
        return None
    mesh, placements, rows = p.device_mesh, tuple(p.placements), p.shape[0]
    if mesh.ndim == 1 and placements == (Shard(0),):
        c = -(-rows // mesh.size())
        return [(min(r * c, rows), min((r + 1) * c, rows)) for r in range(mesh.size())]
    if mesh.ndim == 2 and len(placements) == 2 and placements[1] == Shard(0):
        outer = placements[0]
        F, E = mesh.shape
        strided = isinstance(outer, _StridedShard) and outer.split_factor == E
        if not (strided and outer.dim == 0 and rows % E == 0):
            return None
        n = rows // E
        c = -(-n // F)
        return [
            (j * n + min(f * c, n), j * n + min((f + 1) * c, n)) for f in range(F) for j in range(E)
        ]
    return None


def _flat_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group whose ranks are ``mesh``'s in flattened order, or None."""
    if mesh.ndim == 1:
        return mesh.get_group()
    return dist.group.WORLD if _spans_world(mesh) else None


def _spans_world(mesh: DeviceMesh) -> bool:
    """A 2-D mesh whose flattened ranks are the world's in order (the expert mesh)."""
    return mesh.mesh.flatten().tolist() == list(range(dist.get_world_size()))


def _shard_numel(p: torch.Tensor) -> int | None:
    """Elements per rank, padded to the largest rank's rows, of an FSDP2-style shard that one
    all-gather over its mesh's ranks reassembles (:func:`_row_spans`); else None."""
    spans = _row_spans(p)
    if spans is None or (p.device_mesh.ndim == 2 and not _spans_world(p.device_mesh)):
        return None
    return max(b - a for a, b in spans) * (p.numel() // p.shape[0])


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def gather_bucket(
    bucket: list[tuple[str, DTensor, int]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """One all-gather of every shard in ``bucket``, cast to ``dtype`` first; yields full tensors."""
    mesh = bucket[0][1].device_mesh
    group = _flat_group(mesh)
    world = group.size()
    total = sum(n for _, _, n in bucket)
    send = local_row(bucket, dtype, total)
    recv = torch.empty(world * total, dtype=dtype, device=send.device)
    all_gather_row(recv, send, group)
    recv = recv.view(world, total)
    offset = 0
    for name, p, n in bucket:
        rows = p.shape[0]
        width = p.numel() // rows
        if mesh.ndim == 1:  # rank r's slice holds rows r*c .. r*c + c - 1: stack them
            full = recv[:, offset : offset + n].reshape(-1, *p.shape[1:])[:rows]
        else:
            full = recv.new_empty((rows, width))
            for r, (a, b) in enumerate(_row_spans(p)):
                full[a:b] = recv[r, offset : offset + (b - a) * width].view(b - a, width)
            full = full.view(p.shape)
        yield name, full
        offset += n


def all_gather_row(recv: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``recv`` (W * n,) = every rank's ``send`` (n,) in rank order (p2p sends on gloo)."""
    if dist.get_backend(group) == "gloo":
        all_gather_into(recv, send, group)
    else:
        dist.all_gather_into_tensor(recv, send, group=group)


def iter_full_params(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    bucket_bytes: int | None = None,
    include: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor in dtype)`` for every parameter (each rank gets them all), or
    only those whose name ``include`` accepts (LoRA adapters).

    FSDP2 shards are gathered in buckets of up to ``bucket_bytes`` with one all-gather each, so
    peak extra memory is about two buckets (or one parameter, when larger), not the model.
    Shards of another layout (the experts under expert parallelism, on their own 2-D mesh)
    fill a bucket of their own beside it, gathered over the same ranks: each expert once.
    Every rank must consume the whole iterator: each bucket is a collective.
    ``bucket_bytes`` defaults to ``GATHER_BUCKET_BYTES`` of the device the gathers run on.
    """
    for bucket in iter_full_buckets(model, dtype, bucket_bytes, include):
        yield from bucket


def iter_full_buckets(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    bucket_bytes: int | None = None,
    include: Callable[[str], bool] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """:func:`iter_full_params` one gather at a time: the full tensors of each bucket (a
    parameter that is not an FSDP2 ``Shard(0)`` shard comes alone, gathered the generic way)."""
    for bucket, out in param_buckets(model, dtype, bucket_bytes, include):
        if isinstance(bucket, list):
            yield list(gather_bucket(bucket, out))
        else:
            name, p = bucket
            full = p.full_tensor() if isinstance(p, DTensor) else p
            yield [(name, full.detach().to(out))]


ShardBucket = list[tuple[str, DTensor, int]]  # (name, shard, elements per rank, padded)


def param_buckets(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    bucket_bytes: int | None = None,
    include: Callable[[str], bool] | None = None,
) -> Iterator[tuple[ShardBucket | tuple[str, torch.Tensor], torch.dtype]]:
    """The parameters in gather order, grouped as :func:`iter_full_params` gathers them:
    ``(bucket, dtype)`` where ``bucket`` is a list of ``(name, DTensor, elements per rank)``
    (FSDP2 ``Shard(0)`` shards on one mesh, cast to ``dtype`` together: one all-gather), or a
    ``(name, parameter)`` pair gathered alone (any other placement). Same on every rank."""
    if bucket_bytes is None:
        bucket_bytes = gather_bucket_bytes(model)
    # one open bucket per (mesh, placements, dtype): expert shards on the 2-D expert mesh and
    # the 1-D FSDP2 shards interleave in named_parameters() but gather separately
    open_buckets: dict[tuple, tuple[ShardBucket, int]] = {}
    for name, p in model.named_parameters():
        if include is not None and not include(name):
            continue
        n = _shard_numel(p)
        out = dtype or p.dtype
        if n is None:  # not an FSDP2 shard: gathered alone, the generic way
            yield (name, p), out
            continue
        key = (p.device_mesh, tuple(p.placements), out)
        nbytes = n * p.device_mesh.size() * out.itemsize
        bucket, size = open_buckets.pop(key, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, out
            bucket, size = [], 0
        bucket.append((name, p, n))
        open_buckets[key] = (bucket, size + nbytes)
    for (*_, out), (bucket, _) in open_buckets.items():
        yield bucket, out


def local_row(bucket: ShardBucket, dtype: torch.dtype, elements: int) -> torch.Tensor:
    """This rank's shards of ``bucket`` back to back, each padded to its per-rank chunk, cast
    to ``dtype``, in a zeroed row of ``elements`` (at least the chunks' sum) on the mesh device:
    what this rank contributes to the bucket's all-gather."""
    mesh = bucket[0][1].device_mesh
    send = torch.zeros(elements, dtype=dtype, device=_mesh_device(mesh))
    offset = 0
    for _, p, n in bucket:
        local = p.to_local().detach().reshape(-1)
        send[offset : offset + local.numel()].copy_(local)
        offset += n
    return send


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU state dict on rank 0 (empty dict elsewhere), for HF export."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)
