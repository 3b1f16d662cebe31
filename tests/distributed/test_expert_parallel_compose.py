"""Expert parallelism with the other training features on 2 gloo ranks (tiny Qwen3-MoE, fp32):
gradient checkpointing (the recomputed forward exchanges tokens again), LoRA (adapters on the
attention, the split experts frozen), and a scalar-head model on the MoE base (critic and reward
model): EP=2 gives EP=1's outputs and gradients (1e-5 relative). Runs under ``make test-ep``.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.ep]


def _model(path: str, kind: str):
    from fsdp_rlhf.config import BackendConfig, LoraConfig
    from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model
    from fsdp_rlhf.models.lora import add_lora

    cpu = torch.device("cpu")
    if kind == "critic":
        torch.manual_seed(0)  # the fresh head, alike on every rank and in every build
        model = load_scalar_model(path, BackendConfig(gradient_checkpointing=True), cpu)
    else:
        model = load_causal_lm(path, BackendConfig(gradient_checkpointing=True), cpu)
    if kind == "lora":
        torch.manual_seed(0)
        add_lora(model, LoraConfig(lora_rank=4, lora_alpha=8), quiet=True)
        for name, p in model.named_parameters():  # B = 0 at init: give the adapters a slope
            if "lora_B" in name:
                p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    return model


def _run(path: str, kind: str, ep, world: int) -> tuple[torch.Tensor, dict]:
    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.forward import response_logprobs, row_values
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.moe import MoEHooks, routing_scope

    model = _model(path, kind)
    mesh = build_mesh(torch.device("cpu"), world)
    shard_model(model, mesh, FSDPConfig(zero_stage=3), bf16=False, ep=ep)
    g = torch.Generator().manual_seed(11 + torch.distributed.get_rank())
    ids = torch.randint(5, 400, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded prompt
    if kind == "critic":
        out = row_values(model, forward_inputs(ids, mask))
        (out * mask).sum().backward()
    else:
        hooks = MoEHooks.attach(model, None, ep)
        inputs = forward_inputs(ids, mask, response_len=6)
        with routing_scope(hooks, None, inputs):
            out, _ = response_logprobs(model, inputs, 6)
            (out.sum() + 0.1 * hooks.aux_loss()).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _compare(rank: int, world: int, path: str) -> dict:
    from fsdp_rlhf.distributed.expert_parallel import new_expert_parallel_groups

    ep = new_expert_parallel_groups(2, "cpu")
    out = {}
    for kind in ("checkpointed", "lora", "critic"):
        ref, ref_grads = _run(path, kind, None, world)
        got, grads = _run(path, kind, ep, world)
        out[kind] = dict(ref=ref, got=got, grads=grads, ref_grads=ref_grads)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def test_checkpointing_lora_and_a_scalar_head_on_the_moe_base_at_ep2(tmp_path):
    from fsdp_rlhf.testing.tiny import build_family

    path = str(build_family(tmp_path, "qwen3_moe", seed=6))
    for rank, res in enumerate(run_distributed(_compare, 2, path)):
        for kind, r in res.items():
            assert r["ref"].abs().max() > 0, (rank, kind)
            assert _rel(r["got"], r["ref"]) < 1e-5, (rank, kind, _rel(r["got"], r["ref"]))
            grads, ref_grads = r["grads"], r["ref_grads"]
            assert grads.keys() == ref_grads.keys() and grads, (rank, kind)
            worst = max(_rel(grads[n], ref_grads[n]) for n in grads if ref_grads[n].abs().max())
            assert worst < 1e-5, (rank, kind, worst)
            experts = [n for n in grads if ".experts." in n]
            if kind == "lora":  # the experts stay frozen: only adapters have gradients
                assert not experts and all("lora_" in n for n in grads), sorted(grads)[:4]
            else:
                assert experts, (rank, kind)


class TinyExperts(torch.nn.Module):
    """Fused experts in transformers 5's layout: 4 experts, hidden 8, intermediate 6."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.num_experts = 4
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 12, 8, generator=g))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 8, 6, generator=g))
        self.act_fn = torch.nn.SiLU()

    def dense(self, x, index, weights):  # the unsplit forward, expert by expert
        out = x * 0 + 0 * (self.gate_up_proj.sum() + self.down_proj.sum())  # grads even if idle
        for t in range(x.shape[0]):
            for j, e in enumerate(index[t].tolist()):
                if 0 <= e < self.num_experts:
                    gate, up = (self.gate_up_proj[e] @ x[t]).chunk(2)
                    out[t] += weights[t, j] * (self.down_proj[e] @ (self.act_fn(gate) * up))
        return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-5 of the larger magnitude (fp32 sums in another order); empty tensors too."""
    return a.shape == b.shape and (a.numel() == 0 or _rel(a, b) < 1e-5 or b.abs().max() == 0)


def _edges(rank: int, world: int) -> dict:
    from fsdp_rlhf.distributed.expert_parallel import distribute_experts, new_expert_parallel_groups

    ep = new_expert_parallel_groups(2, "cpu")
    out = {}
    cases = {
        # every token on both ranks chooses experts of group 0: rank 1's experts get nothing
        "one group": (5, lambda g: torch.randint(0, 2, (5, 2), generator=g)),
        # ids outside [0, 4) (transformers' "no expert" sentinel) choose nothing
        "sentinel": (5, lambda g: torch.where(torch.rand(5, 2, generator=g) < 0.3, 4,
                                              torch.randint(0, 4, (5, 2), generator=g))),
        # rank 1 has no tokens at all this forward
        "empty rank": (3 if rank == 0 else 0, lambda g: torch.randint(0, 4, (3, 2), generator=g)),
    }  # fmt: skip
    for name, (tokens, draw) in cases.items():
        g = torch.Generator().manual_seed(10 + rank)
        index = draw(g)[:tokens]
        weights = torch.rand(tokens, 2, generator=g)
        ref_module, module = TinyExperts(), TinyExperts()
        distribute_experts(module, ep)
        x = torch.randn(tokens, 8, generator=g, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        got = module(x, index, weights)
        ref = ref_module.dense(x_ref, index, weights)
        (got * torch.arange(1.0, 9.0)).sum().backward()
        (ref * torch.arange(1.0, 9.0)).sum().backward()
        grad = module.gate_up_proj.grad.to_local()
        out[name] = dict(
            out=_close(got, ref),
            input_grad=x.grad is not None and _close(x.grad, x_ref.grad),
            # this rank's experts' gradient: the other rank's tokens' too (reduced here by hand)
            grads_exist=module.down_proj.grad is not None and grad is not None,
            local=(grad, ref_module.gate_up_proj.grad),
        )
    return out


def test_expert_parallel_forward_edge_cases():
    """One expert group idle, ids that choose no expert, a rank without tokens: the split
    forward equals the unsplit one, input gradients too, and every rank's expert weights get
    a gradient (FSDP2 reduces them on every rank), summed over the ranks' tokens."""
    per_rank = run_distributed(_edges, 2)
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            assert r["out"] and r["input_grad"] and r["grads_exist"], (rank, name)
    for name in per_rank[0]:
        for rank in range(2):  # the split grads hold every rank's tokens; the dense ones each
            got = per_rank[rank][name]["local"][0]  # this rank's experts 2 rank, 2 rank + 1
            want = sum(per_rank[r][name]["local"][1] for r in range(2))[2 * rank : 2 * rank + 2]
            assert _close(got, want), (rank, name)
    assert per_rank[1]["one group"]["local"][0].abs().max() == 0  # nothing reached group 1
