"""Ulysses sequence parallelism on 2 gloo ranks: SP=2 gives the log-probs, entropies, values,
losses and gradients of the unsplit forward (fp32, 1e-5 relative) on padded, packed and
shared-prefix batches, for a GQA Qwen2 (6 query / 2 KV heads) and one with fewer KV heads than
ranks (4 query / 1 KV head, repeated), for the causal LM (PPO's response log-probs, SFT/DPO's
label log-probs) and the scalar-head models (critic values, reward scores).

Both ranks form one sequence-parallel group and hold the same rows; the reference is the same
weights unsharded, unsplit, in one process. Runs under ``make test-sp``.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.ppo_batches import ppo_layout_batch

pytestmark = [pytest.mark.slow, pytest.mark.sp]

SHAPES = {
    # hidden 96 = 6 heads of 16; GQA 3:1, KV heads divide by N = 2
    "gqa_6_2": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
    # one KV head for two ranks: repeated before the all-to-all
    "kv_1": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1),
}
VOCAB = 61
P, T = 7, 6  # L = 13: odd, so the rows are padded to a multiple of 2 before slicing
# padded rows over the explicit CPU kernel's length (SDPA's kernels): left and right padding
LONG_P, LONG_T = 101, 500


def _config(shape: str, scalar: bool = False):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        intermediate_size=80,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        tie_word_embeddings=False,
        **SHAPES[shape],
    )
    if scalar:
        cfg.num_labels = 1
    return cfg


def _fresh(shape: str, scalar: bool, layout: str):
    """The same weights on every call (seeded init), with the attention the layout runs."""
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from fsdp_rlhf.models.attention import (
        PADDED_ATTENTION,
        register_attention,
        use_varlen_attention,
    )

    register_attention()
    torch.manual_seed(0)
    cls = Qwen2ForSequenceClassification if scalar else Qwen2ForCausalLM
    model = cls(_config(shape, scalar)).float()
    model.set_attn_implementation(PADDED_ATTENTION)
    if layout in ("packed", "shared_pairs"):
        use_varlen_attention(model, "cpu")
    model.train()  # dropout is 0: train mode only takes the backward paths
    return model


def _split(model, sp):
    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.ulysses import use_ulysses_attention

    use_ulysses_attention(model)
    mesh = build_mesh(torch.device("cpu"), 2)
    return shard_model(model, mesh, FSDPConfig(), bf16=False, grad_reduce="mean", dp_size=1)


def _ppo_rows():
    g = torch.Generator().manual_seed(7)
    ids, mask, rmask = ppo_layout_batch(g, VOCAB, [7, 7, 3, 3], [6, 2, 4, 1], P, T)
    ids[1, :P], ids[3, :P] = ids[0, :P], ids[2, :P]  # groups of 2 share their prompt
    adv = torch.randn(4, T, generator=g) * rmask
    return ids, mask, rmask, adv


def _long_padded_rows():
    g = torch.Generator().manual_seed(13)
    ids, mask, rmask = ppo_layout_batch(g, VOCAB, [60, 101, 1], [440, 500, 17], LONG_P, LONG_T)
    adv = torch.randn(3, LONG_T, generator=g) * rmask
    return ids, mask, rmask, adv


def _pair_rows():
    """2 preference pairs, right-padded: chosen rows then rejected rows sharing a prompt."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, VOCAB, (2, 5), generator=g)
    lens = [(6, 3), (2, 5)]  # (chosen, rejected) response lengths
    L = 5 + 6
    ids = torch.zeros(4, L, dtype=torch.long)
    mask = torch.zeros(4, L, dtype=torch.long)
    labels = torch.zeros(4, L, dtype=torch.bool)
    for i, (c, r) in enumerate(lens):
        for row, n in ((i, c), (2 + i, r)):
            ids[row, :5] = prompt[i]
            ids[row, 5 : 5 + n] = torch.randint(3, VOCAB, (n,), generator=g)
            mask[row, : 5 + n] = 1
            labels[row, 5 : 5 + n] = True
    return ids, mask, labels


def _run(model, kind: str, layout: str, sp=None):
    """One forward + a loss of every output (split over ``sp`` when given); returns
    (outputs, loss)."""
    from fsdp_rlhf.models.forward import response_logprobs, sequence_scores, token_values
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.label_logprobs import label_logprobs

    if kind == "policy":
        ids, mask, rmask, adv = _ppo_rows()
        lp, ent = response_logprobs(
            model,
            forward_inputs(
                ids,
                mask,
                packed=layout == "packed",
                group_size=2 if layout == "shared" else 1,
                sp=sp,
                response_len=T,
            ),
            T,
            temperature=0.7,
            with_entropy=True,
        )
        n = rmask.sum()
        loss = -(lp * adv).sum() / n - 0.01 * (ent * rmask).sum() / n
        return torch.stack([lp * rmask, ent * rmask]), loss
    if kind == "long_padded":  # SDPA's kernels on rows with padding: no mask under Ulysses
        ids, mask, rmask, adv = _long_padded_rows()
        lp, _ = response_logprobs(model, forward_inputs(ids, mask, sp=sp), LONG_T)
        return lp * rmask, -(lp * adv).sum() / rmask.sum()
    if kind == "long":  # no padding, over the explicit kernel's length: SDPA's causal kernel
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(3, VOCAB, (2, 530), generator=g)
        mask = torch.ones_like(ids)
        lp, _ = response_logprobs(
            model, forward_inputs(ids, mask, packed=layout == "packed", sp=sp), 500
        )
        return lp, -lp.mean()
    if kind == "labels":  # sft/dpo: label log-probs of the responses of preference pairs
        ids, mask, labels = _pair_rows()
        inputs = forward_inputs(
            ids, mask, packed=layout == "packed", pairs=layout == "shared_pairs", sp=sp
        )
        lp = label_logprobs(model, inputs, labels)
        return lp, -lp.sum() / labels.sum()
    if kind == "values":
        ids, mask, rmask, adv = _ppo_rows()
        v = token_values(model, forward_inputs(ids, mask, packed=layout == "packed", sp=sp))
        v = v[:, -T - 1 : -1] * rmask
        return v, ((v - adv) ** 2).sum() / rmask.sum()
    # scores: the reward model over pairs (shared prefixes with the packed layout)
    ids, mask, _ = _pair_rows()
    inputs = forward_inputs(
        ids, mask, packed=layout == "packed", pairs=layout == "shared_pairs", sp=sp
    )
    s = sequence_scores(model, inputs)
    return s, -torch.nn.functional.logsigmoid(s[:2] - s[2:]).mean()


CASES = [
    ("policy", "padded"),
    ("policy", "packed"),
    ("policy", "shared"),
    ("long", "padded"),
    ("long", "packed"),
    ("long_padded", "padded"),
    ("labels", "padded"),
    ("labels", "packed"),
    ("labels", "shared_pairs"),
    ("values", "padded"),
    ("values", "packed"),
    ("scores", "padded"),
    ("scores", "shared_pairs"),
]


def _compare(rank: int, world: int, shape: str) -> dict:
    from fsdp_rlhf.distributed.layout import build_layout

    parallel = build_layout(2)
    sp = parallel.sp
    assert sp.size == 2 and parallel.dp_size == 1 and sp.rank == rank
    out = {}
    for kind, layout in CASES:
        scalar = kind in ("values", "scores")
        ref_model = _fresh(shape, scalar, layout)
        ref, ref_loss = _run(ref_model, kind, layout)
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
        model = _split(_fresh(shape, scalar, layout), sp)
        got, loss = _run(model, kind, layout, sp)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out[(kind, layout)] = (got.detach(), ref.detach(), float(loss), float(ref_loss))
        out[(kind, layout, "grads")] = {n: (grads[n], ref_grads[n]) for n in ref_grads}
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sp2_equals_the_unsplit_forward_and_backward(shape):
    per_rank = run_distributed(_compare, 2, shape)
    for rank in range(2):
        res = per_rank[rank]
        for kind, layout in CASES:
            got, ref, loss, ref_loss = res[(kind, layout)]
            assert ref.abs().max() > 0, (kind, layout)
            assert _rel(got, ref) < 1e-5, (rank, kind, layout, _rel(got, ref))
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (rank, kind, layout)
            worst = 0.0
            for g, rg in res[(kind, layout, "grads")].values():
                if rg.abs().max() == 0:  # e.g. the LM head of the scalar model is not used
                    continue
                worst = max(worst, _rel(g, rg))
            assert worst < 1e-5, (rank, kind, layout, worst)
    # both ranks of the group return the same whole-row results
    for case in CASES:
        torch.testing.assert_close(per_rank[0][case][0], per_rank[1][case][0], rtol=0, atol=0)


def _saved_for_backward(rank: int, world: int) -> dict:
    """The tensors an SP=2 forward of padded rows (left and right padding, SDPA's kernels)
    saves for backward, by size."""
    from fsdp_rlhf.distributed.layout import build_layout
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs

    sp = build_layout(2).sp
    model = _split(_fresh("gqa_6_2", False, "padded"), sp)
    ids, mask, rmask, adv = _long_padded_rows()
    sizes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append((t.numel(), tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = response_logprobs(model, forward_inputs(ids, mask, sp=sp), LONG_T)
    (-(lp * adv).sum()).backward()
    return {"sizes": sizes, "L": ids.shape[1], "rows": ids.shape[0]}


def test_padded_rows_keep_no_l_by_l_tensor_for_backward():
    """Each attention layer of padded rows ran through SDPA with an (B, 1, L, L) mask, which
    SDPA keeps for backward (as a bias in the compute dtype): ~2 GiB per layer and row at 32k
    tokens, whole on every rank. Rows whose tokens form one run (every row the trainers build)
    now take SDPA's causal kernels, row by row where there is left padding."""
    for res in run_distributed(_saved_for_backward, 2):
        L = res["L"]
        largest = max(res["sizes"])
        assert largest[0] < L * L, largest
