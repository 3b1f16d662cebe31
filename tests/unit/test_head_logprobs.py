"""Log-probs from the output layer's input (issue #45, finding 9): ``algorithms.head_logprobs``
equals ``gathered_logprobs`` of the materialised logits in values and in the gradients of the
hidden states and the weight, and ``models.head`` runs it inside the model's forward. The
memory test records every tensor the forward and backward create: before this change the
update made the (B, T, V) logits and their gradient, now no tensor is vocabulary-sized over
the tokens."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_rlhf.algorithms import gathered_logprobs, head_logprobs
from fsdp_rlhf.algorithms import logprobs as logprobs_module
from fsdp_rlhf.models.forward import response_logprobs
from fsdp_rlhf.models.head import fusable_head, model_logprobs
from fsdp_rlhf.models.inputs import forward_inputs
from tests.ppo_batches import ppo_layout_batch


def _problem(dtype=torch.float64, seed=0, V=37, H=6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, H, generator=g, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 2).requires_grad_(True)
    # (3, 4) labels read at rows of the 10 flattened positions: rows twice, row 0 never
    index = torch.tensor([[1, 1, 2, 2], [5, 6, 9, 8], [3, 4, 7, 1]])
    labels = torch.randint(0, V, (3, 4), generator=g)
    labels[0, 0], labels[1, 1] = 0, V - 1  # the first and the last vocabulary block
    return hidden, weight, index, labels, g


@pytest.mark.parametrize("block_size", [1, 5, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_values_and_grads_equal_the_materialised_logits(block_size, temperature, entropy_grad):
    hidden, weight, index, labels, g = _problem()
    w_lp = torch.randn(3, 4, generator=g, dtype=torch.float64)
    w_ent = torch.randn(3, 4, generator=g, dtype=torch.float64)
    kw = dict(temperature=temperature, with_entropy=True, entropy_grad=entropy_grad)

    def grads(fn):
        lp, ent = fn()
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0.0)
        hidden.grad = weight.grad = None
        loss.backward()
        return lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()

    got = grads(lambda: head_logprobs(hidden, weight, labels, index, block_size=block_size, **kw))
    want = grads(lambda: gathered_logprobs(hidden @ weight.t(), labels, index, **kw))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert got[2].reshape(-1, 6)[0].abs().sum() == 0  # row 0 of hidden predicts no label
    lp, ent = head_logprobs(hidden, weight, labels, index, **kw)
    assert ent.requires_grad == entropy_grad


def test_aligned_hidden_states_and_gradcheck():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[1, 8, 0], [2, 2, 4]])

    def fn(h, w):
        return head_logprobs(h, w, labels, temperature=0.8, with_entropy=True, block_size=2)

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_a_frozen_weight_gets_no_gradient_and_half_precision_is_upcast():
    hidden, weight, index, labels, _ = _problem(torch.bfloat16, V=300, H=16)
    weight.requires_grad_(False)
    lp, ent = head_logprobs(hidden, weight, labels, index, with_entropy=True, block_size=64)
    assert lp.dtype == ent.dtype == torch.float32
    ref_lp, ref_ent = gathered_logprobs(hidden @ weight.t(), labels, index, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-2, atol=1e-2)
    lp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad is None


class _Allocations(TorchDispatchMode):
    """The shape of every tensor an op returns (views included: they cost nothing but say
    which shapes exist)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _vocab_model(vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_rlhf.models.attention import PADDED_ATTENTION, register_attention

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    register_attention()
    model.set_attn_implementation(PADDED_ATTENTION)
    return model


@pytest.mark.parametrize("layout", ["padded", "shared", "packed"])
def test_the_update_makes_no_vocabulary_sized_tensor_over_the_tokens(layout, monkeypatch):
    """Forward and backward of one micro-batch's log-probs (entropy as a metric, as the actor
    update runs them): no op returns a tensor of a quarter of (tokens x V) elements or more,
    besides the (V, H) weight-shaped ones. Before issue #45 the model's (B, T, V) logits and
    their gradient were such tensors."""
    V, B, P, T = 4096, 4, 6, 12
    chunk = 1 << 14  # blocks of 16k elements: a small fraction of the 48 x 4096 logits
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", chunk)
    model = _vocab_model(V)
    g = torch.Generator().manual_seed(3)
    ids, mask, _ = ppo_layout_batch(g, V, [6, 6, 3, 3], [12, 5, 9, 12], P, T)
    ids[1, :P], ids[3, :P] = ids[0, :P], ids[2, :P]  # groups of 2 rows share a prompt
    if layout == "packed":
        from fsdp_rlhf.models.attention import use_varlen_attention

        use_varlen_attention(model, "cpu")
    with _Allocations() as seen:
        inputs = forward_inputs(
            ids, mask, packed=layout == "packed", group_size=2 if layout == "shared" else 1,
            response_len=T,
        )  # fmt: skip
        lp, ent = response_logprobs(model, inputs, T, with_entropy=True, entropy_grad=False)
        (lp.sum() + 0.0 * ent.sum()).backward()
    weight_shaped = {(V, 32), (32, V)}
    vocab_sized = B * T * V // 4
    big = [(op, s) for op, s in seen.shapes if s not in weight_shaped and _numel(s) >= vocab_sized]
    assert not big, big
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_the_output_layer_computes_log_probs_where_the_model_allows_it():
    model = _vocab_model(64)
    assert fusable_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0  # Gemma-style: logits change after the layer
    assert fusable_head(model) is None
    model.config.final_logit_softcapping = None
    model.lm_head = torch.nn.Linear(32, 64, bias=True)
    assert fusable_head(model) is None


def test_a_model_that_changes_its_logits_unannounced_is_refused():
    model = _vocab_model(64)
    forward = type(model).forward

    def scaled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled.__get__(model)
    ids = torch.randint(0, 64, (1, 5))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=4)
    with pytest.raises(RuntimeError, match="LOGITS_POST_PROCESSING"):
        model_logprobs(model, inputs, ids[:, 1:], None)
    assert "forward" not in vars(model.lm_head)  # the layer's own forward is back


def test_a_policy_with_suppressed_tokens_keeps_the_masked_logits():
    """A VLM policy masks its placeholder tokens with a hook on the output layer
    (models.vision.suppress_tokens): its log-probs come from the masked logits (the fused
    path would skip the hook; it failed every VLM forward in make test-vlm)."""
    from fsdp_rlhf.algorithms import gathered_logprobs
    from fsdp_rlhf.models.vision import suppress_tokens

    model = _vocab_model(64)
    ids = torch.randint(0, 60, (1, 6))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=5)
    suppress_tokens(model, [61, 62, 63])
    assert fusable_head(model) is None
    lp, _ = model_logprobs(model, inputs, ids[:, 1:], None)
    want, _ = gathered_logprobs(model(**inputs).logits, ids[:, 1:], None)
    torch.testing.assert_close(lp, want)
