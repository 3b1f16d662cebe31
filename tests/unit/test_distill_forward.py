"""The model-level pieces of on-policy distillation's top-k losses: the teacher's top-k tokens
(``models.forward.topk_at``) and the student's log-probs of them from the update's own forward
(``response_logprobs(..., picked_ids=...)``), against the model's materialised logits, through
the fused output layer and the materialised one, padded, shared-prompt and packed rows."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.models.forward import response_logprobs, response_positions, topk_at
from fsdp_rlhf.models.head import fusable_head
from fsdp_rlhf.models.inputs import forward_inputs
from tests.ppo_batches import ppo_layout_batch
from tests.unit.test_head_logprobs import _vocab_model

V, P, T, K = 53, 6, 7, 4


def _batch(layout: str, model):
    """The rows, and the model's own (B, T, V) log-probs of them (before packing switches its
    attention to the varlen kernel)."""
    g = torch.Generator().manual_seed(5)
    ids, mask, response_mask = ppo_layout_batch(g, V, [6, 6, 3, 3], [7, 4, 6, 7], P, T)
    ids[1, :P], ids[3, :P] = ids[0, :P], ids[2, :P]  # groups of 2 rows share a prompt
    direct = _direct(model, ids, mask)
    if layout == "packed":
        from fsdp_rlhf.models.attention import use_varlen_attention

        use_varlen_attention(model, "cpu")
    inputs = forward_inputs(
        ids, mask, packed=layout == "packed", group_size=2 if layout == "shared" else 1,
        response_len=T,
    )  # fmt: skip
    return ids, mask, response_mask, inputs, direct


def _direct(model, ids, mask):
    """(B, T, V) log-probs of each response position, from the model's own logits."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return torch.log_softmax(logits[:, P - 1 : -1].float(), -1)


@pytest.mark.parametrize("layout", ["padded", "shared", "packed"])
@pytest.mark.parametrize("fused", [True, False])
def test_teacher_topk_and_student_picked_logprobs(layout, fused):
    model = _vocab_model(V)
    if not fused:  # a forward hook on the output layer makes its logits necessary
        model.lm_head.register_forward_hook(lambda m, a, out: out)
    assert (fusable_head(model) is not None) == fused
    ids, mask, response_mask, inputs, direct = _batch(layout, model)
    valid = response_mask.bool()
    values, top = topk_at(model, inputs, response_positions(inputs, T), K)
    want = direct.detach().topk(K, -1)
    torch.testing.assert_close(values[valid], want.values[valid], rtol=1e-5, atol=1e-5)
    assert torch.equal(top[valid], want.indices[valid])

    weights = torch.randn(*top.shape, generator=torch.Generator().manual_seed(1))
    lp, ent, picked = response_logprobs(model, inputs, T, with_entropy=True, picked_ids=top)
    torch.testing.assert_close(picked[valid], values[valid], rtol=1e-5, atol=1e-5)
    loss = (picked * weights * response_mask[..., None]).sum() + (lp * response_mask).sum()
    grads = torch.autograd.grad(loss, [model.lm_head.weight, model.model.embed_tokens.weight])
    labels = ids[:, -T:]
    direct_lp = direct.gather(-1, labels[..., None]).squeeze(-1)
    direct_picked = direct.gather(-1, top)
    want_loss = (direct_picked * weights * response_mask[..., None]).sum()
    want_loss = want_loss + (direct_lp * response_mask).sum()
    want_grads = torch.autograd.grad(
        want_loss, [model.lm_head.weight, model.model.embed_tokens.weight]
    )
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
