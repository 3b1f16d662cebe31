"""gpt-oss's attention sinks in every kernel path of the trainer (issue 51): a tiny gpt-oss with
nonzero sinks gives the log-probs of transformers' own eager attention (which implements the
sinks) in padded, packed and shared-prompt forwards, and on 2 gloo ranks with Ulysses sequence
parallelism (padded and packed), with the gradients of the unsplit forward. Without the sinks
the log-probs differ, so the comparison can fail."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.ppo_batches import ppo_layout_batch

pytestmark = [pytest.mark.slow, pytest.mark.sp]

VOCAB = 61
P, T = 7, 20  # rows of 27 tokens: longer than the sliding window of 8


def _model(attn: str, layout: str = "padded", sliding: bool = True):
    from transformers import GptOssConfig, GptOssForCausalLM

    from fsdp_rlhf.models.attention import register_attention, use_varlen_attention

    register_attention()
    cfg = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention" if sliding else "full_attention", "full_attention"],
        max_position_embeddings=256,
        pad_token_id=0,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 2)
    if layout == "packed":
        use_varlen_attention(model, "cpu")
    model.train()
    return model


def _rows():
    g = torch.Generator().manual_seed(7)
    ids, mask, rmask = ppo_layout_batch(g, VOCAB, [7, 7, 3, 3], [20, 12, 9, 4], P, T)
    ids[1, :P], ids[3, :P] = ids[0, :P], ids[2, :P]  # groups of 2 share their prompt
    return ids, mask, rmask


def _logprobs(model, layout: str, sp=None):
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs

    ids, mask, rmask = _rows()
    inputs = forward_inputs(
        ids,
        mask,
        packed=layout == "packed",
        group_size=2 if layout == "shared" else 1,
        sp=sp,
        response_len=T,
    )
    lp, _ = response_logprobs(model, inputs, T)
    return lp * rmask, rmask


def test_sinks_in_padded_packed_and_shared_prompt_forwards_match_eager():
    from fsdp_rlhf.models.attention import PADDED_ATTENTION

    assert "sdpa" not in PADDED_ATTENTION  # transformers would check gpt-oss for SDPA support
    ref, rmask = _logprobs(_model("eager"), "padded")
    for layout in ("padded", "packed"):
        with torch.enable_grad():
            got, _ = _logprobs(_model(PADDED_ATTENTION, layout), layout)
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-5, msg=layout)
    # shared prompts are for full-attention layers only (models.shared_prefix.sharing_blocker)
    full_ref, _ = _logprobs(_model("eager", sliding=False), "padded")
    got, _ = _logprobs(_model(PADDED_ATTENTION, sliding=False), "shared")
    torch.testing.assert_close(got, full_ref, rtol=0, atol=2e-5, msg="shared")
    no_sinks = _model(PADDED_ATTENTION)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.zero_()
    assert (_logprobs(no_sinks, "padded")[0] - ref).abs().max() > 1e-3


def _compare(rank: int, world: int) -> dict:
    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.distributed.layout import build_layout
    from fsdp_rlhf.models.attention import PADDED_ATTENTION
    from fsdp_rlhf.models.ulysses import use_ulysses_attention

    sp = build_layout(2).sp
    out = {}
    for layout in ("padded", "packed"):
        ref_model = _model("eager")
        ref, rmask = _logprobs(ref_model, "padded")
        ref_loss = -ref.sum() / rmask.sum()
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
        model = _model(PADDED_ATTENTION, layout)
        use_ulysses_attention(model)
        mesh = build_mesh(torch.device("cpu"), 2)
        model = shard_model(model, mesh, FSDPConfig(), bf16=False, grad_reduce="mean", dp_size=1)
        got, _ = _logprobs(model, layout, sp)
        (-got.sum() / rmask.sum()).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out[layout] = (got.detach(), ref.detach())
        out[(layout, "grads")] = {n: (grads[n], ref_grads[n]) for n in ref_grads}
    return out


def test_sinks_under_ulysses_match_the_unsplit_eager_forward_and_backward():
    results = run_distributed(_compare, world_size=2)
    for out in results:
        for layout in ("padded", "packed"):
            got, ref = out[layout]
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-5, msg=layout)
            for name, (g, r) in out[(layout, "grads")].items():
                rel = float((g - r).abs().max() / r.abs().max().clamp(min=1e-30))
                assert rel < 1e-4, (layout, name, rel)
