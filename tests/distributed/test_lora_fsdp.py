"""LoRA under FSDP2 on 2 gloo ranks, in bf16: the reference forward (adapters disabled) may be
the actor's first forward, which is when FSDP2 fixes each group's gradient dtypes."""

from __future__ import annotations

import torch

from fsdp_rlhf.config import BackendConfig, FSDPConfig, LoraConfig
from tests.dist_utils import run_distributed


def _reference_first_then_update(rank: int, world: int, model_path: str) -> int:
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models import lora
    from fsdp_rlhf.models.load import load_causal_lm
    from tests.dist_utils import current_env

    env = current_env()
    model = lora.add_lora(load_causal_lm(model_path, BackendConfig(), env.device),
                          LoraConfig(lora_rank=4), quiet=True)  # fmt: skip
    shard_model(model, build_mesh(env.device, world), FSDPConfig(), bf16=True)
    ids = torch.randint(
        2, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(rank)
    )
    with torch.no_grad(), lora.adapters_disabled(model):
        model(input_ids=ids)
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    # gradients are reduced and kept in fp32 beside the fp32 master weights
    assert {p.grad.dtype for p in trained} == {torch.float32}
    return 0


def test_lora_bf16_backward_after_a_reference_first_forward(tiny_qwen2):
    assert run_distributed(_reference_first_then_update, 2, tiny_qwen2) == [0, 0]
