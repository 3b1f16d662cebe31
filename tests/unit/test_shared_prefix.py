"""Shared-prompt forwards (models.shared_prefix): the same log-probs and gradients as the padded
forward of every sample, on published-shaped models, in training (explicit CPU attention) and
no-grad (SDPA) mode, eager and with compiled blocks."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.models.compile import compile_blocks
from fsdp_rlhf.models.forward import response_logprobs
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.models.load import load_causal_lm
from fsdp_rlhf.models.shared_prefix import (
    share_prompts,
    shared_group_size,
    sharing_blocker,
)
from tests.ppo_batches import ppo_layout_batch

PROMPTS = [5, 2, 7]  # real prompt tokens of each group; the batch pads them to P = 9
RESPONSES = [[6, 1, 4, 6], [3, 6, 6, 2], [1, 1, 5, 6]]  # per sample, padded to T = 6
P, T, S = 9, 6, 4


def grouped_batch(vocab: int, seed: int = 0, prompts=PROMPTS, responses=RESPONSES):
    """Groups of S samples sharing a left-padded prompt, responses right-padded: (G*S, P+T)."""
    g = torch.Generator().manual_seed(seed)
    plens = [p for p in prompts for _ in range(S)]
    rlens = [r for rs in responses for r in rs]
    ids, mask, rmask = ppo_layout_batch(g, vocab, plens, rlens, P, T)
    for i in range(len(prompts)):  # every sample of a group gets its group's first prompt
        rows = slice(i * S, (i + 1) * S)
        ids[rows, :P] = ids[i * S, :P]
    return ids, mask, rmask


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _logprobs_and_grads(model, ids, mask, group_size):
    model.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(
        model,
        forward_inputs(ids, mask, group_size=group_size, response_len=T),
        T,
        with_entropy=True,
    )
    weights = torch.linspace(0.5, 2.0, lp.shape[0])[:, None]
    (lp * weights + 0.1 * ent).sum().backward()
    return lp.detach(), ent.detach(), _grads(model)


@pytest.mark.parametrize("model_fixture", ["tiny_qwen2", "tiny_llama"])
@pytest.mark.parametrize("group_size", [2, 4])
def test_shared_prompt_training_forward_matches_padded(model_fixture, group_size, request):
    model = load_causal_lm(request.getfixturevalue(model_fixture), BackendConfig(), "cpu")
    ids, mask, rmask = grouped_batch(model.config.vocab_size)
    lp_ref, ent_ref, g_ref = _logprobs_and_grads(model, ids, mask, 1)
    lp, ent, g = _logprobs_and_grads(model, ids, mask, group_size)
    on = rmask.bool()
    torch.testing.assert_close(lp[on], lp_ref[on], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[on], ent_ref[on], rtol=1e-5, atol=1e-5)
    assert g.keys() == g_ref.keys() and g
    for name, grad in g.items():
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, g_ref[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("model_fixture", ["tiny_qwen2", "tiny_llama"])
def test_shared_prompt_no_grad_forward_matches_padded(model_fixture, request):
    model = load_causal_lm(request.getfixturevalue(model_fixture), BackendConfig(), "cpu")
    ids, mask, rmask = grouped_batch(model.config.vocab_size, seed=3)
    with torch.no_grad():
        ref, _ = response_logprobs(model, forward_inputs(ids, mask), T, temperature=0.7)
        got, _ = response_logprobs(
            model, forward_inputs(ids, mask, group_size=S, response_len=T), T, temperature=0.7
        )
    on = rmask.bool()
    torch.testing.assert_close(got[on], ref[on], rtol=1e-5, atol=1e-5)


def test_shared_prompt_sees_masked_response_tokens_as_the_padded_row_does(tiny_qwen2):
    """A response token with attention mask 0 in the middle (not only right padding) is hidden
    from the later tokens in both layouts, and positions skip it in both."""
    model = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    ids, mask, rmask = grouped_batch(model.config.vocab_size, seed=5)
    mask[1, P + 1] = 0
    rmask[1, 1] = 0
    with torch.no_grad():
        ref, _ = response_logprobs(model, forward_inputs(ids, mask), T)
        got, _ = response_logprobs(
            model, forward_inputs(ids, mask, group_size=S, response_len=T), T
        )
    on = rmask.bool()
    torch.testing.assert_close(got[on], ref[on], rtol=1e-5, atol=1e-5)


def test_shared_prompt_rows_layout():
    ids, mask, _ = grouped_batch(vocab=50)
    rows = share_prompts(ids, mask, T, S)
    longest = max(PROMPTS)
    assert rows.input_ids.shape == (3, longest + S * T)  # common left padding is cut
    assert rows.prompt_mask.shape == (3, 1, 1, longest)
    assert rows.response_mask.shape == (3 * S, 1, 1, T)
    # group 1: prompt of 2 tokens, its responses continue at positions 2, 3, ...
    assert rows.position_ids[1, longest - 2 : longest].tolist() == [0, 1]
    assert rows.position_ids[1, longest : longest + 3].tolist() == [2, 3, 4]
    assert rows.logit_index[:, 0].tolist() == [0] * S  # every first token: the prompt's last
    assert rows.logit_index[1, 1].item() == T + 1


def test_share_prompts_refuses_rows_that_do_not_share_a_prompt():
    ids, mask, _ = grouped_batch(vocab=50)
    ids[5, P - 1] = (ids[5, P - 1] + 1) % 50
    with pytest.raises(ValueError, match="do not share their prompt"):
        share_prompts(ids, mask, T, S)
    with pytest.raises(ValueError, match="groups of 5"):
        share_prompts(ids, mask, T, 5)


def test_group_size_divides_samples_and_every_batch_cut():
    assert shared_group_size(4, 8, 16) == 4
    assert shared_group_size(8, 2, 16) == 2  # micro-batch of 2: pairs share their prompt
    assert shared_group_size(4, 3, 12) == 1  # no common factor: no sharing
    assert shared_group_size(1, 8, 8) == 1  # PPO with one sample per prompt


def test_sharing_blockers(tiny_qwen2):
    model = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    assert sharing_blocker(model, packed=False) is None
    assert "packing" in sharing_blocker(model, packed=True)
    other = copy.deepcopy(model)
    other.set_attn_implementation("sdpa")
    assert "sdpa" in sharing_blocker(other, packed=False)


def test_shared_prompt_compiled_blocks_match_eager_without_recompiling(tiny_qwen2):
    """Compiled blocks take the shared-prompt layout at any prompt and response length after
    the first call of each mode (a recompile per batch would stall every step)."""
    import torch._dynamo

    eager = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compile_blocks(compiled)
    batches = [
        grouped_batch(eager.config.vocab_size, seed=7),
        grouped_batch(eager.config.vocab_size, 8, [3, 4, 1], [[2, 2, 2, 2]] * 3),
        grouped_batch(eager.config.vocab_size, 9, [8, 6, 9], [[5, 6, 6, 6]] * 3),
    ]
    for i, (ids, mask, rmask) in enumerate(batches):
        cut = int(rmask.sum(-1).max()) if i == 1 else T  # a narrower response window too
        ids, mask, rmask = ids[:, : P + cut], mask[:, : P + cut], rmask[:, :cut]
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got, _ = response_logprobs(
                compiled, forward_inputs(ids, mask, group_size=S, response_len=cut), cut
            )
            got.sum().backward()
        ref, _ = response_logprobs(eager, forward_inputs(ids, mask), cut)
        on = rmask.bool()
        torch.testing.assert_close(got[on], ref[on].detach(), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- preference pairs (train-rm)


def pair_batch(vocab: int, seed: int = 0):
    """4 pairs, right-padded, B chosen rows then B rejected rows (collate_pairs' layout): a
    shared 6-token prompt then different replies; a reply that extends the other; pairs equal
    but for the last token; no common prefix at all."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompt, reply = rand(6), rand(5)
    pairs = [
        (prompt + rand(4), prompt + rand(7)),
        (prompt + reply, prompt + reply + rand(3)),
        (reply + [7], reply + [8]),
        ([5] + rand(5), [6] + rand(8)),
    ]
    seqs = [c for c, _ in pairs] + [r for _, r in pairs]
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


def test_shared_pair_row_layout():
    from fsdp_rlhf.models.shared_prefix import share_pair_prefixes

    ids, mask = pair_batch(vocab=50)
    row = share_pair_prefixes(ids, mask)
    # the prompt (6); all of the shorter reply but its last token (10); all but the last (5); 0
    assert row.prefix_lens.tolist() == [6, 10, 5, 0]
    lens, packed = mask.sum(-1), row.packed
    assert packed.cu_seqlens.diff().tolist() == [10, 7, 11, 4, 6, 1, 6, 9]
    assert packed.input_ids.shape[1] == int(lens.sum() - row.prefix_lens.sum())
    # the rejected rest continues the prefix's positions
    assert packed.position_ids[0, 10:17].tolist() == list(range(6, 13))
    assert row.model_inputs()["shared_prefix_lens"] is row.prefix_lens
    ends = packed.cu_seqlens[1:] - 1
    assert row.last_index.tolist() == [*ends[0::2].tolist(), *ends[1::2].tolist()]


@pytest.mark.parametrize("explicit_max_len", [512, 0])  # explicit attention; SDPA kernels
@pytest.mark.parametrize("model_fixture", ["tiny_qwen2", "tiny_llama"])
def test_shared_pair_scores_and_grads_match_padded(
    model_fixture, explicit_max_len, request, monkeypatch
):
    from fsdp_rlhf.models import attention
    from fsdp_rlhf.models.attention import use_varlen_attention
    from fsdp_rlhf.models.forward import sequence_scores
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_scalar_model

    monkeypatch.setattr(attention, "CPU_EXPLICIT_ATTENTION_MAX_LEN", explicit_max_len)
    path = request.getfixturevalue(model_fixture)
    padded = load_scalar_model(path, BackendConfig(), "cpu", value_head_prefix="score")
    padded.config.pad_token_id = 0
    shared = copy.deepcopy(padded)
    use_varlen_attention(shared)
    ids, mask = pair_batch(padded.config.vocab_size, seed=1)
    a = sequence_scores(padded, forward_inputs(ids, mask))
    b = sequence_scores(shared, forward_inputs(ids, mask, pairs=True))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(1.0, 2.0, a.shape[0])
    (a * weights).sum().backward()
    (b * weights).sum().backward()
    for (name, p), q in zip(padded.named_parameters(), shared.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
