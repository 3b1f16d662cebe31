"""models.label_logprobs: log-probs of marked tokens, padded / packed / shared-prefix pairs,
against a plain log_softmax over the full logits, with gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.models.attention import use_varlen_attention
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.models.label_logprobs import label_logprobs, sequence_logprobs
from fsdp_rlhf.models.load import load_causal_lm
from tests.unit.test_shared_prefix import pair_batch


def _reference(model, ids, mask, label_mask):
    """log_softmax over every position, the marked labels picked by hand."""
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    out = torch.zeros(ids.shape)
    keep = label_mask.bool() & mask.bool()
    out[:, 1:] = torch.where(keep[:, 1:], lp, 0.0)
    return out


def _label_mask(mask: torch.Tensor, start: list[int]) -> torch.Tensor:
    cols = torch.arange(mask.shape[1])
    return (cols[None] >= torch.tensor(start)[:, None]) & mask.bool()


@pytest.mark.parametrize(
    "model_fixture, layout",
    [("tiny_qwen2", "padded"), ("tiny_qwen2", "packed"), ("tiny_qwen2", "shared"),
     ("tiny_llama", "shared")],
)  # fmt: skip
def test_matches_full_log_softmax_with_grads(model_fixture, layout, request):
    path = request.getfixturevalue(model_fixture)
    ref = load_causal_lm(path, BackendConfig(), torch.device("cpu"))
    model = copy.deepcopy(ref)
    if layout != "padded":
        use_varlen_attention(model, "cpu")
    ids, mask = pair_batch(ref.config.vocab_size, seed=2)
    # responses start after 6 prompt tokens on the first two pairs, at 1 on the others
    label_mask = _label_mask(mask, [6, 6, 1, 1, 6, 6, 1, 1])
    want = _reference(ref, ids, mask, label_mask)
    inputs = forward_inputs(ids, mask, packed=layout == "packed", pairs=layout == "shared")
    got = label_logprobs(model, inputs, label_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[~(label_mask.bool() & mask.bool())] == 0).all()
    weights = torch.linspace(0.5, 2.0, ids.shape[0])
    (want.sum(-1) * weights).sum().backward()
    (sequence_logprobs(model, inputs, label_mask) * weights).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
