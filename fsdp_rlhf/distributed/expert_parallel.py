"""Expert parallelism (``--expert_parallel_size E``): each MoE layer's routed experts split over
the E ranks of an expert group, tokens sent to their experts and the outputs sent back.

Layout. The W ranks of the world form W / E expert groups of E consecutive ranks (as sequence-
parallel groups are cut); rank ``g * E + j`` holds the j-th E-th of every MoE layer's experts.
The W / E ranks with the same ``j`` (one per expert group) hold the same experts: FSDP2 shards
those experts' weights over them (torchtitan's "dp_shard mod ep" mesh), while every other
weight stays sharded over the whole world as without EP. Both are one 2-D device mesh
``(efsdp, ep)`` of shape ``(W / E, E)``: an expert tensor is a DTensor over it, ``Shard(0)`` on
``ep`` (the experts) and FSDP2's ``_StridedShard(0)`` on ``efsdp`` (rows within them), so every
element lives on exactly one rank and checkpoints (DCP) reshard between expert-parallel sizes.

Forward of one MoE layer (:func:`expert_parallel_forward`, taking the place of the fused experts
module's own): the router runs as before on this rank's tokens; each (token, chosen expert)
pair is sent, sorted by expert, to the rank of its expert group that holds the expert
(``all_to_all_single`` with the counts exchanged first); each rank runs its experts on what it
received and sends the outputs back the same way; the outputs are weighted by the router and
summed per token. Both exchanges are differentiable (the gradient goes back along the reverse
exchange), so an expert's gradient collects every token of its expert group that chose it,
and FSDP2's reduction over ``efsdp`` then sums the groups. Gradients are divided by the same
factor as every other weight's (the data-parallel size), not by the ``efsdp`` size FSDP2
would use on its own.

Any rank may route any token anywhere: sequence parallelism (each rank its slice of the rows)
and router replay (the replayed experts are the ones the hooks hand to the experts) compose
without change. Every forward of an MoE layer is a collective over the expert group, as every
FSDP2 forward already is over the world: ranks run the same forwards in the same order.

Shapes: W ranks, E ranks per expert group, N experts per layer (``N % E == 0``), ``n = N / E``
local experts, T tokens on this rank, k experts per token, H hidden, I expert intermediate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

EXPERT_MESH_DIMS = ("efsdp", "ep")  # (ranks holding the same experts, ranks splitting them)


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's expert-parallel groups (size 1: every rank holds every expert).

    Attributes:
        size: E, ranks that split each MoE layer's experts.
        rank: this rank's place in its expert group (which E-th of the experts it holds).
        group: the E ranks of this rank's expert group: tokens are dispatched to their experts
            and combined back over it.
        replica_group: the W / E ranks holding the same experts as this one: the expert
            weights' shards and gradients reduce over it.
        mesh: the 2-D ``(efsdp, ep)`` device mesh both groups come from (None when E == 1).
    """

    size: int = 1
    rank: int = 0
    group: ProcessGroup | None = None
    replica_group: ProcessGroup | None = None
    mesh: DeviceMesh | None = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def local_experts(self, num_experts: int) -> range:
        """The ids of the experts (of ``num_experts`` per layer) this rank holds."""
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)


def expert_parallel_problem(size: int, world_size: int, num_experts: int | None) -> str | None:
    """Why ``--expert_parallel_size size`` cannot split ``num_experts`` experts per layer over
    ``world_size`` ranks, or None (``num_experts`` None or 0: a dense model)."""
    if size < 1:
        return f"--expert_parallel_size {size}: must be at least 1"
    if size == 1:
        return None
    if world_size % size:
        return f"--expert_parallel_size {size} does not divide the world size {world_size}"
    if not num_experts:
        return f"--expert_parallel_size {size}: the model is dense (no routed experts to split)"
    if num_experts % size:
        return (
            f"--expert_parallel_size {size} does not divide the model's {num_experts} experts "
            "per MoE layer"
        )
    return None


def new_expert_parallel_groups(size: int, device_type: str) -> ExpertParallel:
    """The expert groups of ``--expert_parallel_size size`` over the default group's world
    (collective: every rank, once, after the default process group exists)."""
    if size == 1:
        return ExpertParallel()
    if not dist.is_initialized():
        raise RuntimeError("expert parallelism needs an initialised process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"expert_parallel_size {size} does not divide the world size {world}")
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=EXPERT_MESH_DIMS)
    return ExpertParallel(
        size=size,
        rank=rank % size,
        group=mesh.get_group("ep"),
        replica_group=mesh.get_group("efsdp"),
        mesh=mesh,
    )


# ---------------------------------------------------------------- the fused experts modules


def is_routed_experts(module: nn.Module) -> bool:
    """A transformers 5 fused experts module: (N, ...) tensors of a block's routed experts."""
    return type(module).__name__.endswith("Experts") and hasattr(module, "num_experts")


def routed_experts(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_routed_experts(m)]


def unsupported_experts(module: nn.Module) -> str | None:
    """Why this module's experts cannot be split by :func:`distribute_experts`, or None. Handled:
    ``gate_up_proj`` (N, 2I, H) with gate and up concatenated and ``down_proj`` (N, H, I), no
    biases, an ``act_fn`` (Qwen2/3/3.5-MoE, OLMoE, Mixtral and the other eager-layout MoEs)."""
    name = type(module).__name__
    params = {n for n, _ in module.named_parameters(recurse=False)}
    if params != {"gate_up_proj", "down_proj"} or not hasattr(module, "act_fn"):
        return f"{name} (parameters {sorted(params)})"
    flags = dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True)
    odd = [k for k, v in flags.items() if getattr(module, k, v) != v]
    if odd:
        return f"{name} ({', '.join(f'{k}={not flags[k]}' for k in odd)})"
    return None


def distribute_experts(module: nn.Module, ep: ExpertParallel) -> None:
    """Keep this rank's n = N / E experts of ``module`` as DTensors (``Shard(0)`` over the
    ``ep`` mesh dimension, global shape unchanged) and route its forward through
    :func:`expert_parallel_forward`. Before ``fully_shard`` (which then shards them over
    ``efsdp``); works on the meta device."""
    problem = unsupported_experts(module)
    if problem is not None:
        raise ValueError(f"expert parallelism: unsupported fused experts {problem}")
    mesh = ep.mesh["ep"]
    span = ep.local_experts(int(module.num_experts))
    for name, param in list(module.named_parameters(recurse=False)):
        local = param.detach()[span.start : span.stop].clone()
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
    # The original (class) forward stays reachable as type(module).forward; the instance's
    # forward now takes the group it exchanges over as an argument bound here.
    module.forward = functools.partial(expert_parallel_forward, module, ep)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; the gradient goes back the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _all_to_all(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """Rows ``x`` (sum(send), ...) sent in blocks of ``send[j]`` to rank j of ``group``; returns
    the (sum(recv), ...) rows received, block j from rank j. Differentiable (gloo has it)."""
    return _Exchange.apply(x, recv, send, group)


@torch.compiler.disable
def expert_parallel_forward(
    module: nn.Module,
    ep: ExpertParallel,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The fused experts' forward with the experts split over ``ep``'s group: (T, H) tokens,
    (T, k) expert ids and mixing weights -> (T, H) weighted sum of the chosen experts'
    outputs, as the module's own forward computes it (ids outside [0, N) choose nothing).
    Collective over ``ep.group``."""
    N, E = int(module.num_experts), ep.size
    n = N // E
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, hence by owning rank; tokens in order
    chosen = flat[order]
    keep = (chosen >= 0) & (chosen < N)
    order, chosen = order[keep], chosen[keep]
    token = order // k
    per_expert = torch.bincount(chosen, minlength=N)  # (N,): rows this rank sends each expert
    recv_counts = torch.empty_like(per_expert)  # rows each rank sends my expert j, (E * n,)
    dist.all_to_all_single(recv_counts, per_expert, group=ep.group)
    recv_counts = recv_counts.view(E, n)
    send = per_expert.view(E, n).sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    arrived = _exchange(hidden_states[token], recv, send, ep.group)
    # rows arrive by source rank, each block sorted by local expert: group them by expert
    local_id = torch.arange(n, device=arrived.device).repeat(E)
    local_id = torch.repeat_interleave(local_id, recv_counts.reshape(-1).to(arrived.device))
    by_expert = torch.argsort(local_id, stable=True)
    per_local = recv_counts.sum(0).tolist()
    out = _run_experts(module, arrived[by_expert], per_local)
    back = torch.empty_like(out)
    back[by_expert] = out  # the arrival order again
    returned = _exchange(back, send, recv, ep.group)
    weights = top_k_weights.reshape(-1)[order]
    final = torch.zeros_like(hidden_states)
    final.index_add_(0, token, (returned * weights[:, None]).to(final.dtype))
    return final


def _run_experts(module: nn.Module, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """This rank's experts on ``rows`` (grouped by local expert, ``counts[j]`` rows for the
    j-th): SwiGLU-style ``down(act(gate(x)) * up(x))`` with the module's activation."""
    gate_up, down = _local(module.gate_up_proj), _local(module.down_proj)
    outs, start = [], 0
    for j, c in enumerate(counts):
        if c == 0:
            continue
        x = rows[start : start + c]
        gate, up = nn.functional.linear(x, gate_up[j]).chunk(2, dim=-1)
        outs.append(nn.functional.linear(module.act_fn(gate) * up, down[j]))
        start += c
    if not outs:
        # Nothing arrived: keep the graph through the rows (their exchange's backward is a
        # collective every rank of the group must run) and the weights (FSDP2 reduces their
        # gradients on every rank).
        return rows.new_zeros((0, down.shape[1])) + 0 * (rows.sum() + gate_up.sum() + down.sum())
    return torch.cat(outs)
