"""An MoE actor under Ulysses sequence parallelism on 2 gloo ranks (tiny Qwen3-MoE, fp32): each
rank routes its own slice of every row, and SP=2 gives the unsplit forward's log-probs, losses,
gradients and ``moe/*`` metrics (1e-5 relative) on padded, packed and shared-prompt batches,
routing for itself and replaying a routing (router replay, R3), with the load-balancing loss in
the loss. Runs under ``make test-sp``.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.sp]

LAYOUTS = ("padded", "packed", "shared")
AUX = 0.1  # --aux_loss_coef of the loss below


def _fresh(path: str, layout: str):
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.attention import use_varlen_attention
    from fsdp_rlhf.models.load import load_causal_lm

    model = load_causal_lm(path, BackendConfig(), torch.device("cpu"))
    if layout == "packed":
        use_varlen_attention(model, "cpu")
    model.train()  # dropout is 0: train mode only takes the backward paths
    return model


def _split(model, sp):
    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.ulysses import use_ulysses_attention

    use_ulysses_attention(model)
    mesh = build_mesh(torch.device("cpu"), 2)
    return shard_model(model, mesh, FSDPConfig(), bf16=False, grad_reduce="mean", dp_size=1)


def _step(model, hooks, batch, routing, layout: str, sp=None):
    """One forward of the batch (split over ``sp`` when given) inside the hooks' routing, the
    PPO-like loss plus AUX x the load-balancing loss, and its backward; returns (log-probs,
    loss, aux loss)."""
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.moe import routing_scope
    from tests.unit.test_shared_prefix import S, T

    ids, mask, rmask, adv = batch
    inputs = forward_inputs(
        ids,
        mask,
        packed=layout == "packed",
        group_size=S if layout == "shared" else 1,
        response_len=T,
        sp=sp,
    )
    with routing_scope(hooks, routing, inputs):
        lp, ent = response_logprobs(model, inputs, T, with_entropy=True)
        n = rmask.sum()
        aux = hooks.aux_loss()
        loss = -(lp * adv).sum() / n - 0.01 * (ent * rmask).sum() / n + AUX * aux
        loss.backward()
    return (lp * rmask).detach(), loss.item(), aux.item()


def _compare(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist

    from fsdp_rlhf.distributed.layout import build_layout
    from fsdp_rlhf.models.moe import MoEHooks
    from tests.unit.test_moe import own_routing, shifted
    from tests.unit.test_shared_prefix import grouped_batch

    sp = build_layout(2).sp
    solo = [dist.new_group([r]) for r in range(world)][rank]  # the reference's metrics: local
    ids, mask, rmask = grouped_batch(400, seed=3)
    adv = torch.randn(rmask.shape, generator=torch.Generator().manual_seed(5)) * rmask
    batch = (ids, mask, rmask, adv)
    plain = _fresh(path, "padded")  # a routing other than the model's own, to replay
    shifted_routing = shifted(own_routing(plain, ids, mask), plain.config.num_experts)
    out = {}
    for layout in LAYOUTS:
        for replay in (False, True):
            ref_model = _fresh(path, layout)
            routing = shifted_routing if replay else None
            ref_hooks = MoEHooks.attach(ref_model)
            ref = _step(ref_model, ref_hooks, batch, routing, layout)
            ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
            model = _split(_fresh(path, layout), sp)
            hooks = MoEHooks.attach(model, sp)
            got = _step(model, hooks, batch, routing, layout, sp)
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            out[layout, replay] = dict(
                got=got,
                ref=ref,
                grads={n: (grads[n], ref_grads[n]) for n in ref_grads},
                metrics=hooks.pop_metrics(),  # over the world: both slices of the rows
                ref_metrics=ref_hooks.pop_metrics(solo),
            )
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def test_moe_actor_sp2_equals_the_unsplit_forward_with_replay_and_aux_loss(tmp_path):
    from fsdp_rlhf.testing.tiny import build_family

    path = str(build_family(tmp_path, "qwen3_moe", seed=4))
    per_rank = run_distributed(_compare, 2, path)
    for rank, res in enumerate(per_rank):
        for (layout, replay), r in res.items():
            case = (rank, layout, replay)
            (lp, loss, aux), (ref_lp, ref_loss, ref_aux) = r["got"], r["ref"]
            assert ref_lp.abs().max() > 0
            assert _rel(lp, ref_lp) < 1e-5, (case, _rel(lp, ref_lp))
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
            assert abs(aux - ref_aux) <= 1e-5 * abs(ref_aux), (case, aux, ref_aux)
            worst = max(_rel(g, rg) for g, rg in r["grads"].values() if rg.abs().max() > 0)
            assert worst < 1e-5, (case, worst)
            router = r["grads"]["model.layers.0.mlp.gate.weight"][1]
            assert router.abs().max() > 0, case  # the router is trained (replayed or not)
            m, ref_m = r["metrics"], r["ref_metrics"]
            assert m.keys() == ref_m.keys() and ref_m, case
            for key, value in ref_m.items():
                assert value == pytest.approx(m[key], rel=1e-6), (case, key)
            # replayed: the agreement of a routing other than the model's is below 1
            assert ("moe/router_replay_agreement" in m) == replay, case
            if replay:
                assert m["moe/router_replay_agreement"] < 0.9, case
    # both ranks of the group return the same whole-row results
    for key in per_rank[0]:
        torch.testing.assert_close(per_rank[0][key]["got"][0], per_rank[1][key]["got"][0])
