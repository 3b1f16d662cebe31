"""The state of an expert-parallel model on 4 gloo ranks (tiny Qwen3-MoE, 16 experts, fp32): rank
0's weights fill an EP=2 skeleton; the weight-sync gather returns every weight exactly, the
experts in buckets of their own (each expert once); an optimizer step runs on the mixed meshes;
the HF export holds every expert in the checkpoint's published per-expert layout; and a
checkpoint written at EP=2 loads at EP=1 and EP=4 (DCP resharding) with the same weights and
optimizer state. Runs under ``make test-ep``.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.ep]


def _load(path: str, ep_size: int):
    """The model as ``trainers.common.load_and_prepare`` builds it: rank 0 loads, every rank
    shards a meta skeleton with experts split ``ep_size`` ways, rank 0's tensors fill it."""
    import torch.distributed as dist

    from fsdp_rlhf.config import BackendConfig, FSDPConfig
    from fsdp_rlhf.distributed.expert_parallel import new_expert_parallel_groups
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.distributed.rank0_load import fill_from_rank0
    from fsdp_rlhf.models.load import load_causal_lm

    cpu = torch.device("cpu")
    ep = new_expert_parallel_groups(ep_size, "cpu")
    full = load_causal_lm(path, BackendConfig(), cpu) if dist.get_rank() == 0 else None
    model = load_causal_lm(path, BackendConfig(), cpu, weights=False)
    mesh = build_mesh(cpu, dist.get_world_size())
    shard_model(model, mesh, FSDPConfig(zero_stage=3), bf16=False, grad_reduce="sum", ep=ep)
    fill_from_rank0(model, full, cpu)
    model.train()
    return model


def _full_optim_state(model, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, opt, options=opts)["state"]
    return {f"{n}.{k}": v.clone() for n, s in state.items() for k, v in s.items() if v.ndim}


def _keys(folder: str) -> set[str]:
    from pathlib import Path

    from safetensors import safe_open

    keys = set()
    for f in Path(folder).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    assert any(".experts.0.gate_proj.weight" in k for k in keys), sorted(keys)[:5]
    return keys


def _states(rank: int, world: int, path: str, ckpt: str) -> dict:
    from fsdp_rlhf.config import BackendConfig, OptimConfig
    from fsdp_rlhf.distributed import checkpoint as ckpt_mod
    from fsdp_rlhf.distributed import fsdp
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.optim import build_optimizer

    ref = {
        n: p.detach()
        for n, p in load_causal_lm(path, BackendConfig(), torch.device("cpu")).named_parameters()
    }
    model = _load(path, 2)
    out = {}
    experts = [n for n, _ in model.named_parameters() if n.endswith("proj") and ".experts." in n]
    out["experts on the 2-D mesh"] = all(
        dict(model.named_parameters())[n].device_mesh.ndim == 2 for n in experts
    )
    out["experts gathered in buckets"] = all(
        fsdp._shard_numel(dict(model.named_parameters())[n]) is not None for n in experts
    )
    gathered = dict(fsdp.iter_full_params(model, bucket_bytes=1 << 30))
    out["fill and gather exact"] = gathered.keys() == ref.keys() and all(
        torch.equal(gathered[n], ref[n]) for n in ref
    )
    small = dict(fsdp.iter_full_params(model, torch.bfloat16, bucket_bytes=4096))
    out["small bf16 buckets exact"] = all(
        torch.equal(small[n], ref[n].to(torch.bfloat16)) for n in ref
    )
    # one optimizer step over the two meshes
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(5, 400, (2, 12), generator=g)
    lp, _ = response_logprobs(model, forward_inputs(ids, torch.ones_like(ids), response_len=6), 6)
    lp.sum().backward()
    opt.step()
    after = dict(fsdp.iter_full_params(model))
    out["the step moved the experts"] = all(not torch.equal(after[n], ref[n]) for n in experts)
    moments = _full_optim_state(model, opt)
    # the HF export: every expert, in the published per-expert layout of the input checkpoint
    from fsdp_rlhf.models.save import save_hf_model

    save_hf_model(model, None, f"{ckpt}-hf")
    if rank == 0:
        exported = load_causal_lm(f"{ckpt}-hf", BackendConfig(), torch.device("cpu"))
        out["export holds every trained expert"] = all(
            torch.equal(p.detach(), after[n]) for n, p in exported.named_parameters()
        )
        out["export in the published layout"] = _keys(f"{ckpt}-hf") == _keys(path)
    ckpt_mod.save_checkpoint(
        ckpt, 1, models={"actor": model}, optimizers={"actor": opt}, schedulers={},
        trainer_state={},
    )  # fmt: skip
    for ep_size in (1, 4):
        other = _load(path, ep_size)
        other_opt = build_optimizer(other, OptimConfig(lr=1e-2))
        # the optimizer state must exist to be loaded into: a zero step
        for p in other.parameters():
            p.grad = torch.zeros_like(p)
        other_opt.step()
        ckpt_mod.load_checkpoint(
            f"{ckpt}/step_1", models={"actor": other}, optimizers={"actor": other_opt},
            schedulers={},
        )  # fmt: skip
        loaded = dict(fsdp.iter_full_params(other))
        out[f"weights at EP={ep_size}"] = all(torch.equal(loaded[n], after[n]) for n in after)
        got = _full_optim_state(other, other_opt)
        out[f"optimizer state at EP={ep_size}"] = got.keys() == moments.keys() and all(
            torch.equal(got[k], moments[k]) for k in moments
        )
    return out


def test_fill_gather_step_and_checkpoint_reshard_between_expert_parallel_sizes(tmp_path):
    from fsdp_rlhf.testing.tiny import build_family

    path = str(build_family(tmp_path / "m", "qwen3_moe", seed=2))
    for result in run_distributed(_states, 4, path, str(tmp_path / "ckpt")):
        assert all(result.values()), result
