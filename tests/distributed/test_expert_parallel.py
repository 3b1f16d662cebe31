"""Expert parallelism (``distributed.expert_parallel``) on gloo ranks, fp32: EP=2 gives EP=1's
log-probs, losses and gradients (1e-5 relative) on tiny Qwen3-MoE and Qwen2-MoE (a shared expert
behind a gate), routing for itself and replaying a routing (router replay, R3), with the
load-balancing loss in the loss; on 4 ranks EP=2 x SP=2 against SP=2 alone. EP=1 is the same
FSDP2 job without expert parallelism: every weight sharded over the world.
Runs under ``make test-ep``.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.ep]

AUX = 0.1  # --aux_loss_coef of the loss below


def _fresh(path: str):
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.load import load_causal_lm

    model = load_causal_lm(path, BackendConfig(), torch.device("cpu"))
    model.train()  # dropout is 0: train mode only takes the backward paths
    return model


def _sharded(path: str, world: int, layout, ep):
    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.ulysses import use_ulysses_attention

    model = _fresh(path)
    if layout.sp.enabled:
        use_ulysses_attention(model)
    mesh = build_mesh(torch.device("cpu"), world)
    return shard_model(model, mesh, FSDPConfig(), bf16=False, dp_size=layout.dp_size, ep=ep)


def _step(model, hooks, batch, routing, sp):
    """One forward inside the hooks' routing, a PPO-like loss plus AUX x the load-balancing
    loss, and its backward; returns (log-probs, loss, aux loss)."""
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.moe import routing_scope
    from tests.unit.test_shared_prefix import T

    ids, mask, rmask, adv = batch
    inputs = forward_inputs(ids, mask, response_len=T, sp=sp if sp.enabled else None)
    with routing_scope(hooks, routing, inputs):
        lp, ent = response_logprobs(model, inputs, T, with_entropy=True)
        n = rmask.sum()
        aux = hooks.aux_loss()
        loss = -(lp * adv).sum() / n - 0.01 * (ent * rmask).sum() / n + AUX * aux
        loss.backward()
    return (lp * rmask).detach(), loss.item(), aux.item()


def _compare(rank: int, world: int, path: str, ep_size: int, sp_size: int) -> dict:
    from fsdp_rlhf.distributed.layout import build_layout
    from fsdp_rlhf.models.moe import MoEHooks
    from tests.unit.test_moe import own_routing, shifted
    from tests.unit.test_shared_prefix import grouped_batch

    layout = build_layout(sp_size, ep_size)
    sp, ep = layout.sp, layout.ep
    ids, mask, rmask = grouped_batch(400, seed=3 + layout.dp_rank)  # each data rank its own rows
    adv = torch.randn(rmask.shape, generator=torch.Generator().manual_seed(5)) * rmask
    batch = (ids, mask, rmask, adv)
    plain = _fresh(path)  # a routing other than the model's own, to replay
    shifted_routing = shifted(own_routing(plain, ids, mask), plain.config.num_experts)
    out = {}
    for replay in (False, True):
        routing = shifted_routing if replay else None
        res = {}
        for name, experts in (("ep1", None), ("ep", ep)):
            model = _sharded(path, world, layout, experts)
            hooks = MoEHooks.attach(model, sp)
            got = _step(model, hooks, batch, routing, sp)
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            res[name] = dict(got=got, grads=grads, metrics=hooks.pop_metrics())
        out[replay] = res
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _check(per_rank: list[dict], loose: tuple[str, ...] = (), loose_rel: float = 1e-3) -> None:
    """EP against EP=1 (see the module docstring); gradients of parameters named with a suffix
    in ``loose`` within ``loose_rel`` instead of 1e-5."""
    for rank, res in enumerate(per_rank):
        for replay, r in res.items():
            case = (rank, replay)
            (lp, loss, aux), (ref_lp, ref_loss, ref_aux) = r["ep"]["got"], r["ep1"]["got"]
            assert ref_lp.abs().max() > 0
            assert _rel(lp, ref_lp) < 1e-5, (case, _rel(lp, ref_lp))
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
            assert abs(aux - ref_aux) <= 1e-5 * abs(ref_aux), (case, aux, ref_aux)
            grads, ref_grads = r["ep"]["grads"], r["ep1"]["grads"]
            assert grads.keys() == ref_grads.keys()
            experts = [n for n in grads if n.endswith(("gate_up_proj", "down_proj"))]
            assert experts and all(ref_grads[n].abs().max() > 0 for n in experts), case
            rel = {n: _rel(grads[n], ref_grads[n]) for n in grads if ref_grads[n].abs().max()}
            worst = max((v, n) for n, v in rel.items() if not n.endswith(loose))
            assert worst[0] < 1e-5, (case, worst)
            assert all(v < loose_rel for n, v in rel.items() if n.endswith(loose)), (case, rel)
            m, ref_m = r["ep"]["metrics"], r["ep1"]["metrics"]
            assert m.keys() == ref_m.keys() and ref_m, case
            for key, value in ref_m.items():
                assert value == pytest.approx(m[key], rel=1e-6), (case, key)
            assert ("moe/router_replay_agreement" in m) == replay, case


@pytest.mark.parametrize(
    "family", [pytest.param("qwen3_moe", marks=pytest.mark.featured), "qwen2_moe"]
)
def test_ep2_equals_ep1_on_two_ranks(family, tmp_path):
    from fsdp_rlhf.testing.tiny import build_family

    path = str(build_family(tmp_path, family, seed=4))
    _check(run_distributed(_compare, 2, path, 2, 1))


def test_ep2_with_sp2_equals_sp2_alone_on_four_ranks(tmp_path):
    from fsdp_rlhf.testing.tiny import build_family

    path = str(build_family(tmp_path, "qwen3_moe", seed=4))
    _check(run_distributed(_compare, 4, path, 2, 2))
