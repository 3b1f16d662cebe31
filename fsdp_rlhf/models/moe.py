"""Mixture-of-experts models in the trainer: their routers, router replay (R3), the
load-balancing loss and routing statistics.

transformers 5 gives each sparse block a router module returning ``(logits, weights, experts)``
for the block's flattened tokens (``weights`` the top-k probabilities the experts' outputs are
mixed with, ``experts`` their ids) and a fused ``experts`` module (``gate_up_proj``
(E, 2I, H), ``down_proj`` (E, H, I)). :class:`MoEHooks` puts a forward hook on every router:

- with a replay (router replay, R3), the experts are the rollout engine's and the weights are
  the router's own probabilities at those experts (renormalised where the router renormalises),
  so gradients reach the router through the weights as in verl's and slime's R3 (Megatron's
  router gathers its scores at the replayed indices); tokens the engine has no routing for
  (padding, each sequence's last token) route for themselves;
- it records what the forward routed: expert loads, router entropy, the replay's agreement
  with the trainer's own top-k, and the differentiable terms of the load-balancing loss.

The hooks stay installed; they act only inside :meth:`MoEHooks.routing`, which the caller
holds over a forward and its backward (activation checkpointing recomputes the forward during
backward and must route the same way; what a recomputation routes is not counted twice).

Under sequence parallelism (``--sequence_parallel_size N``, ``models.ulysses``) each rank's
routers see its 1/N slice of every row: the hooks cut the replayed experts and the real-token
mask the way ``shard_inputs`` cuts the token ids, the load-balancing loss sums its token counts
and router probabilities over the group (so every rank computes the unsplit forward's loss),
and the statistics, each rank counting its own slice, are summed over the world as before.

Supported routers (:data:`ROUTERS`, ``models.routers.ROUTER_RULES``): every router class with
a rule there (softmax, softmax over the chosen, sigmoid with correction bias, grouped top-k,
normalisation and scaling, Gemma 4's per-expert scales); the replayed experts' weights are
recomputed by that rule. Others are refused by name where router replay or the auxiliary loss
is asked for (the rules table, ``fsdp_rlhf.rules``, row ``moe-flags-unknown-router``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fsdp_rlhf.distributed.collectives import all_reduce
from fsdp_rlhf.distributed.expert_parallel import ExpertParallel, is_routed_experts
from fsdp_rlhf.distributed.sequence_parallel import SequenceParallel
from fsdp_rlhf.models.inputs import ForwardInputs
from fsdp_rlhf.models.routers import (
    ROUTER_RULES,
    RouterRule,
    expert_probs,
    join_output,
    replay_weights,
    router_num_experts,
    router_top_k,
    split_output,
)

ROUTERS: dict[str, RouterRule] = ROUTER_RULES


def _looks_like_router(module: nn.Module) -> bool:
    name = type(module).__name__
    return name in ROUTERS or (name.endswith("Router") and hasattr(module, "top_k"))


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's supported MoE routers, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


def is_moe(model: nn.Module) -> bool:
    return any(_looks_like_router(m) for m in model.modules())


def is_router(module: nn.Module) -> bool:
    return type(module).__name__ in ROUTERS


# ---------------------------------------------------------------- parameters


def expert_group_load(counts: torch.Tensor, ep_size: int) -> dict[str, float]:
    """Tokens per expert group (the experts one rank of an expert-parallel group holds) from
    one step's (MoE layers, experts) assignment counts over the world: the most (token,
    expert) pairs one group's experts ran in one layer, and the worst layer's max over mean
    across the groups (1: even; ``ep_size``: one group ran everything)."""
    Lm, n = counts.shape
    groups = counts.reshape(Lm, ep_size, n // ep_size).sum(-1)  # (Lm, ep_size)
    mean = groups.mean(-1).clamp(min=1e-9)
    return {
        "moe/ep_group_tokens_max": float(groups.max()),
        "moe/ep_group_load_max_mean": float((groups.max(-1).values / mean).max()),
    }


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Parameters of the routed experts (fused (E, ...) tensors of each block's ``experts``)."""
    names = []
    for name, module in model.named_modules():
        if is_routed_experts(module):
            names += [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
    return names


def never_adapted(model: nn.Module) -> list[str]:
    """Modules of an MoE model LoRA leaves alone: routed experts, routers, and a shared
    expert's gate (Qwen2-MoE's ``shared_expert_gate``, an (1, H) ``nn.Linear``)."""
    out = []
    for name, module in model.named_modules():
        routed = is_routed_experts(module)
        if routed or _looks_like_router(module) or name.endswith("shared_expert_gate"):
            out.append(name)
    return out


def active_parameters(model: nn.Module) -> tuple[int, int]:
    """(total, active per token) parameter counts: a token runs top_k of each block's
    ``num_experts`` routed experts, and every other parameter."""
    total = sum(p.numel() for p in model.parameters())
    routers = [m for m in model.modules() if _looks_like_router(m)]
    if not routers:
        return total, total
    top_k = router_top_k(routers[0])
    inactive = 0
    for module in model.modules():
        if is_routed_experts(module):
            experts = sum(p.numel() for p in module.parameters(recurse=False))
            inactive += experts * (module.num_experts - top_k) // module.num_experts
    return total, total - inactive


# ---------------------------------------------------------------- layouts


@contextmanager
def routing_scope(
    moe: MoEHooks | None,
    routed: torch.Tensor | None,
    inputs: ForwardInputs,
    *,
    collect: bool = True,
) -> Iterator[None]:
    """``moe.routing`` for one forward (``inputs``, ``models.inputs``), replaying ``routed``
    (B, L, Lm, k), aligned with the padded rows, when given; nothing for a dense model
    (``moe`` None). Both the replay and the real-token mask are laid out as the model rows
    hold their tokens (``ForwardInputs.arrange``), whatever parts built them."""
    if moe is None:
        yield
        return
    replay = inputs.arrange(routed) if routed is not None else None
    valid = inputs.arrange(inputs.attention_mask)
    with moe.routing(replay=replay, valid=valid, collect=collect):
        yield


# ---------------------------------------------------------------- hooks


@dataclass
class _Forward:
    """One forward (and its backward) inside ``MoEHooks.routing``."""

    replay: torch.Tensor | None  # (n, Lm, k) long, the flattened forward layout
    valid: torch.Tensor  # (n,) bool: real tokens (statistics and aux loss count these)
    collect: bool
    seen: set[int] = field(default_factory=set)
    counts: list[torch.Tensor] = field(default_factory=list)  # per layer (E,) float
    prob_sums: list[torch.Tensor] = field(default_factory=list)  # per layer (E,), with grad


def _local_slice(x: torch.Tensor, sp: SequenceParallel, fill: int) -> torch.Tensor:
    """(B', L', ...) in a forward's token layout -> this rank's (B', Lr, ...) slice of it, cut
    as ``models.ulysses.shard_inputs`` cuts the token ids (rows padded with ``fill`` to N * Lr)."""
    from fsdp_rlhf.models.ulysses import local_range

    L = x.shape[1]
    start, stop = local_range(L, sp)
    padded = x.new_full((x.shape[0], (stop - start) * sp.size, *x.shape[2:]), fill)
    padded[:, :L] = x
    return padded[:, start:stop]


class MoEHooks:
    """Router hooks of one model (see the module docstring). ``None`` from :meth:`attach` for
    a dense model. ``sp``: the sequence-parallel layout the model's forwards are split over;
    ``ep``: the expert-parallel groups its experts are split over (for the load per group)."""

    def __init__(
        self,
        model: nn.Module,
        routers: list[nn.Module],
        sp: SequenceParallel | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        self.routers = routers
        self.sp = sp if sp is not None and sp.enabled else None
        self.ep_size = ep.size if ep is not None else 1
        self.num_experts = router_num_experts(routers[0])
        self.top_k = router_top_k(routers[0])
        self._rules = [ROUTERS[type(r).__name__] for r in routers]
        self._current: _Forward | None = None
        # Where the routers run, known at the first routed forward: not the parameters' device,
        # which is the host under --adam_offload (CPUOffloadPolicy) while routers run on the GPU.
        self._totals = self._zero_totals(torch.device("cpu"))
        for slot, router in enumerate(routers):
            router.register_forward_hook(self._hook(slot))

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        sp: SequenceParallel | None = None,
        ep: ExpertParallel | None = None,
    ) -> MoEHooks | None:
        routers = moe_routers(model)
        return cls(model, routers, sp, ep) if routers else None

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def _totals_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The step's running totals, moved to ``device`` (where the routers run) if needed."""
        if self._totals["counts"].device != device:
            self._totals = {k: v.to(device) for k, v in self._totals.items()}
        return self._totals

    def _zero_totals(self, device) -> dict[str, torch.Tensor]:
        Lm, E = len(self.routers), self.num_experts
        return {
            "counts": torch.zeros(Lm, E, dtype=torch.float64, device=device),
            "entropy": torch.zeros(Lm, dtype=torch.float64, device=device),
            "tokens": torch.zeros(Lm, dtype=torch.float64, device=device),
            "agree": torch.zeros((), dtype=torch.float64, device=device),
            "replayed": torch.zeros((), dtype=torch.float64, device=device),
        }

    @contextmanager
    def routing(
        self, *, replay: torch.Tensor | None, valid: torch.Tensor, collect: bool
    ) -> Iterator[None]:
        """Hold over one forward and its backward.

        Args:
            replay: (B', L', Lm, k) expert ids in the forward's token layout
                (``ForwardInputs.arrange``), or None to route as the model does.
            valid: (B', L') real tokens in the same layout.
            (Whole rows: under sequence parallelism this rank's slice is taken here.)
            collect: count this forward in the step's statistics (its aux loss is there
                either way).
        """
        if replay is not None:
            if replay.shape[-2:] != (self.num_layers, self.top_k):
                raise ValueError(
                    f"router replay: routing for {tuple(replay.shape[-2:])} (MoE layers, "
                    f"experts per token), the model has ({self.num_layers}, {self.top_k})"
                )
            replay = replay.long()
            if self.sp is not None:  # -1: the slice's padding routes for itself
                replay = _local_slice(replay, self.sp, -1)
            replay = replay.reshape(-1, self.num_layers, self.top_k)
        valid = valid.bool()
        if self.sp is not None:
            valid = _local_slice(valid, self.sp, False)
        self._current = _Forward(replay, valid.reshape(-1), collect)
        try:
            yield
        finally:
            self._current = None

    def _hook(self, slot: int):
        def hook(module: nn.Module, args, output):
            fwd = self._current
            if fwd is None:
                return None
            return self._route(slot, module, fwd, output)

        return hook

    def _route(self, slot: int, module: nn.Module, fwd: _Forward, output):
        rule = self._rules[slot]
        scores, weights, experts = split_output(rule, output)
        if scores.shape[0] != fwd.valid.numel():
            raise RuntimeError(
                f"MoE layer {slot}: {scores.shape[0]} tokens routed, {fwd.valid.numel()} expected"
            )
        first = slot not in fwd.seen  # a recomputation in backward is not counted again
        fwd.seen.add(slot)
        probs = expert_probs(rule, scores)
        if fwd.replay is not None:
            replay = fwd.replay[:, slot]
            has = ((replay >= 0) & (replay < self.num_experts)).all(-1, keepdim=True)
            if first and fwd.collect:
                with torch.no_grad():
                    same = (experts.sort(-1).values == replay.sort(-1).values).all(-1)
                    counted = has.squeeze(-1) & fwd.valid
                    t = self._totals_on(experts.device)
                    t["agree"] += (same & counted).sum()
                    t["replayed"] += counted.sum()
            experts = torch.where(has, replay, experts.to(replay.dtype))
            # the engine's experts, weighed by the router's own rule from its own scores
            weights = replay_weights(rule, module, scores, experts, weights.dtype)
        # the same differentiable ops in a recomputation (activation checkpointing checks
        # that the recomputed forward saves what the forward saved); kept only the first time
        prob_sum = (probs * fwd.valid.to(probs.dtype).unsqueeze(-1)).sum(0)
        if first:
            self._count(slot, fwd, probs, prob_sum, experts)
        return join_output(rule, output, weights, experts)

    def _count(
        self,
        slot: int,
        fwd: _Forward,
        probs: torch.Tensor,
        prob_sum: torch.Tensor,
        experts: torch.Tensor,
    ) -> None:
        valid = fwd.valid
        with torch.no_grad():
            chosen = experts[valid].reshape(-1)
            counts = torch.zeros(self.num_experts, dtype=torch.float32, device=probs.device)
            counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
        fwd.counts.append(counts)
        fwd.prob_sums.append(prob_sum)
        if not fwd.collect:
            return
        with torch.no_grad():
            t = self._totals_on(probs.device)
            t["counts"][slot] += counts.double()
            entropy = -(probs * torch.log(probs.clamp_min(1e-20))).sum(-1)
            t["entropy"][slot] += entropy[valid].sum().double()
            t["tokens"][slot] += valid.sum().double()

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the forward inside the current ``routing``: Switch
        Transformer's, as transformers' ``load_balancing_loss_func`` computes it (what
        OpenRLHF's ``--aux_loss_coef`` weights): ``E * sum_e f_e * P_e`` with ``f_e`` the top-k
        assignments of expert e and ``P_e`` its router probability, each summed over the MoE
        layers and real tokens and divided by their product. ``k`` when the load is uniform;
        differentiable through ``P``. With router replay, ``f`` counts the replayed experts.

        Under sequence parallelism the sums are over the group (collective: every rank of it
        calls this), so each rank gets the unsplit forward's loss and, in backward, the
        gradient of its own slice's probabilities."""
        fwd = self._current
        if fwd is None or not fwd.counts:
            raise RuntimeError("aux_loss: no MoE forward inside routing()")
        assigned = torch.stack(fwd.counts).sum(0)  # (E,) over the layers
        prob_sum = torch.stack(fwd.prob_sums).sum(0)
        tokens = fwd.valid.sum().to(torch.float32)
        if self.sp is not None:
            from fsdp_rlhf.models.ulysses import combine_disjoint

            E = self.num_experts
            flat = torch.cat([prob_sum, assigned.to(prob_sum.dtype), tokens[None]])
            flat = combine_disjoint(flat, self.sp.group)
            prob_sum, assigned, tokens = flat[:E], flat[E : 2 * E], flat[2 * E]
        rows = tokens.clamp(min=1) * len(fwd.counts)
        return self.num_experts * (assigned / rows * (prob_sum / rows)).sum()

    def pop_metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        # Under expert parallelism the counts are still those of every rank's routers: the
        # world's tokens, whichever rank's experts ran them.
        """The step's ``moe/*`` metrics over all ranks (collective), then reset."""
        t = self._totals
        parts = [t["counts"].flatten(), t["entropy"], t["tokens"]]
        flat = all_reduce(torch.cat([*parts, t["agree"][None], t["replayed"][None]]), group=group)
        Lm, E = self.num_layers, self.num_experts
        counts = flat[: Lm * E].view(Lm, E)
        entropy, tokens = flat[Lm * E : Lm * E + Lm], flat[Lm * E + Lm : Lm * E + 2 * Lm]
        agree, replayed = flat[-2], flat[-1]
        self._totals = self._zero_totals(t["counts"].device)
        if float(tokens.sum()) == 0:
            return {}
        share = counts / counts.sum(-1, keepdim=True).clamp(min=1)
        load = (share.max(-1).values * E).tolist()  # max over mean share, per layer
        out = {f"moe/expert_load_max_mean/layer_{i}": v for i, v in enumerate(load)}
        out["moe/expert_load_max_mean"] = max(load)
        out["moe/router_entropy"] = float((entropy / tokens.clamp(min=1)).mean())
        if self.ep_size > 1:
            out.update(expert_group_load(counts, self.ep_size))
        if float(replayed) > 0:
            out["moe/router_replay_agreement"] = float(agree / replayed)
        return out
