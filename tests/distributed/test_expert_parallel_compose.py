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
    from fsdp_rlhf.models.moe import MoEHooks, routing_scope

    model = _model(path, kind)
    mesh = build_mesh(torch.device("cpu"), world)
    shard_model(model, mesh, FSDPConfig(zero_stage=3), bf16=False, ep=ep)
    g = torch.Generator().manual_seed(11 + torch.distributed.get_rank())
    ids = torch.randint(5, 400, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded prompt
    if kind == "critic":
        out = row_values(model, {"input_ids": ids, "attention_mask": mask})
        (out * mask).sum().backward()
    else:
        hooks = MoEHooks.attach(model, None, ep)
        with routing_scope(hooks, None, mask, 6):
            out, _ = response_logprobs(model, ids, mask, 6)
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
