"""The actor's EMA (``--enable_ema``) on FSDP2 shards, 2 gloo ranks: it equals the EMA of the
full weights computed on one process, its export is that EMA (and leaves the trained weights
untouched), and a checkpoint restores it exactly, also onto one rank."""

from __future__ import annotations

import torch

from fsdp_rlhf.config import BackendConfig, FSDPConfig
from tests.dist_utils import run_distributed

BETA = 0.8


def _sharded(model_path: str, world: int):
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.load import load_causal_lm
    from tests.dist_utils import current_env

    env = current_env()
    model = load_causal_lm(model_path, BackendConfig(), env.device)
    shard_model(model, build_mesh(env.device, world), FSDPConfig(zero_stage=3), bf16=False)
    return model


def _gather(model) -> dict[str, torch.Tensor]:
    """Full weights on rank 0, copied: on one CPU rank the gathered tensors are the live
    parameters themselves."""
    from fsdp_rlhf.distributed.fsdp import gather_full_state_dict

    return {k: v.clone() for k, v in gather_full_state_dict(model).items()}


def _train_and_save(rank: int, world: int, model_path: str, ckpt_dir: str):
    from fsdp_rlhf.distributed.checkpoint import save_checkpoint
    from fsdp_rlhf.distributed.ema import ShardedEMA

    torch.manual_seed(0)
    model = _sharded(model_path, world)
    full = {k: v.float() for k, v in _gather(model).items()}
    expected = dict(full)  # the EMA of the full weights, on rank 0 only
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = ShardedEMA(model, BETA)
    ema.attach(opt)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(2, model.config.vocab_size, (2, 8), generator=g)
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        now = _gather(model)
        for k in expected:
            expected[k] = BETA * expected[k] + (1 - BETA) * now[k].float()
    trained = _gather(model)
    with ema.applied() as averaged:
        exported = _gather(averaged)
    after = _gather(model)
    save_checkpoint(
        ckpt_dir,
        3,
        models={"actor": model},
        optimizers={"actor": opt},
        schedulers={"actor_ema": ema},
        trainer_state={},
    )
    resumed = _resume(rank, world, model_path, ckpt_dir)  # into a fresh model and EMA
    if rank != 0:
        return None
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {
        "ema_error": max((exported[n] - expected[n]).abs().max().item() for n in names),
        "moved": max((exported[n] - full[n]).abs().max().item() for n in names),
        "restored": all(torch.equal(trained[n], after[n]) for n in trained),
        "exported": {n: exported[n] for n in names},
        "shards": sorted({str(t.device) for t in ema.shadow.values()}),
        "resumed": resumed,
    }


def _resume(rank: int, world: int, model_path: str, ckpt_dir: str):
    from fsdp_rlhf.distributed.checkpoint import load_checkpoint
    from fsdp_rlhf.distributed.ema import ShardedEMA

    model = _sharded(model_path, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = ShardedEMA(model, BETA)
    load_checkpoint(
        f"{ckpt_dir}/step_3",
        models={"actor": model},
        optimizers={"actor": opt},
        schedulers={"actor_ema": ema},
    )
    with ema.applied() as averaged:
        exported = _gather(averaged)
    return exported if rank == 0 else None


def test_sharded_ema_matches_full_weights_and_resumes_exactly(tiny_qwen2, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = run_distributed(_train_and_save, 2, tiny_qwen2, ckpt, timeout=300)[0]
    assert out["ema_error"] < 1e-6, out["ema_error"]
    assert out["moved"] > 1e-4  # the EMA left the initial weights
    assert out["restored"]  # the export put the trained weights back bit for bit
    assert out["shards"] == ["cpu"]
    # the same world, and resharded onto one rank
    for resumed in (out["resumed"], run_distributed(_resume, 1, tiny_qwen2, ckpt)[0]):
        for name, value in out["exported"].items():
            assert torch.equal(resumed[name], value), name
