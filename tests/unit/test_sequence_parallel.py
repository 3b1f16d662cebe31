"""Sequence parallelism's pure parts: which head counts split, the data-parallel batch plans,
the size checks before anything loads, rollouts merged in a group, the memory model per rank,
and the context-length check of long generation. The forwards themselves run on 2 ranks in
tests/distributed/test_sequence_parallel.py (``make test-sp``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_rlhf.config import (
    FSDPConfig,
    PairBatchConfig,
    PPOConfig,
    plan_offline_batches,
    plan_ppo_batches,
)
from fsdp_rlhf.config_base import ConfigError, build_config
from fsdp_rlhf.distributed.layout import ParallelLayout, build_layout
from fsdp_rlhf.distributed.memory import (
    GIB,
    JobFlags,
    ModelShape,
    activation_bytes,
    attention_mask_bytes,
    plan_phases,
    sequence_parallel_needed,
    sequence_parallel_options,
)
from fsdp_rlhf.distributed.sequence_parallel import SequenceParallel, share_range
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.ulysses import head_problem
from fsdp_rlhf.rollout import RolloutOutput


@pytest.mark.parametrize(
    "heads,kv,n,ok",
    [(6, 2, 2, True), (4, 1, 2, True), (8, 2, 4, True), (9, 3, 2, False), (8, 3, 4, False)],
)
def test_heads_split_when_queries_divide_and_kv_heads_divide_or_repeat(heads, kv, n, ok):
    problem = head_problem(heads, kv, n)
    assert (problem is None) == ok
    if not ok:  # one line naming both numbers
        assert str(n) in problem and (str(heads) in problem or str(kv) in problem)


def test_shares_are_contiguous_and_cover_everything():
    assert [share_range(5, 2, i) for i in range(2)] == [(0, 3), (3, 5)]
    assert [share_range(4, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    items = list(range(7))
    parts = [SequenceParallel(size=3, rank=r).share(items) for r in range(3)]
    assert sum(parts, []) == items and [len(p) for p in parts] == [3, 2, 2]
    assert SequenceParallel().share(items) == items
    one = build_layout()  # no process group: one rank, its own data shard
    assert one.sp.size == 1 and one.dp_size == 1 and one.data_group is None
    four = ParallelLayout(world_size=4, rank=3, sp=SequenceParallel(size=2, rank=1))
    assert (four.dp_size, four.dp_rank) == (2, 1)
    with pytest.raises(ValueError, match="does not divide"):
        ParallelLayout(world_size=3, sp=SequenceParallel(size=2))


def test_batch_plans_count_data_parallel_ranks():
    batch = PairBatchConfig(train_batch_size=16, micro_train_batch_size=2)
    plan = plan_offline_batches(batch, 4, 2)
    assert (plan.world_size, plan.dp_size, plan.batch_size_per_rank) == (4, 2, 8)
    assert plan.grad_accum_steps == 4
    with pytest.raises(ConfigError, match=r"sequence_parallel_size \(3\) must divide the world"):
        plan_offline_batches(batch, 4, 3)
    with pytest.raises(ConfigError, match="data-parallel size"):
        plan_offline_batches(PairBatchConfig(train_batch_size=6, micro_train_batch_size=2), 4, 2)
    argv = "--pretrain x --rollout_batch_size 4 --n_samples_per_prompt 4 --train_batch_size 16 "
    argv += "--micro_train_batch_size 2 --micro_rollout_batch_size 8 --sequence_parallel_size 2"
    cfg, _ = build_config(PPOConfig, argv.split())
    plan = plan_ppo_batches(cfg, 4)
    # the group's rows: 4 x 4 / 2 data ranks; each rank still generates 4 / 4 prompts
    assert (plan.dp_size, plan.train_batch_size_per_rank) == (2, 8)
    with pytest.raises(ConfigError, match="must be >= 1"):
        FSDPConfig(sequence_parallel_size=0)


def _config_only(root: Path, heads: int, kv: int, **extra) -> str:
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64 * heads,
        "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 2,
        "intermediate_size": 256, "vocab_size": 512, **extra,
    }  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def test_sizes_are_checked_against_every_model_before_loading(tmp_path):
    """The rules table's sequence-parallel rows read every model's heads from its config."""
    from fsdp_rlhf.rules import check_command

    ok = _config_only(tmp_path / "ok", 6, 2)
    one_kv = _config_only(tmp_path / "kv1", 4, 1)
    nine = _config_only(tmp_path / "nine", 9, 3)

    def ppo(n: int, pretrain: str, reward: str | None = None):
        argv = ["--pretrain", pretrain, "--sequence_parallel_size", str(n)]
        argv += (
            ["--reward_pretrain", reward] if reward else ["--advantage_estimator", "reinforce++"]
        )
        return build_config(PPOConfig, argv)[0]

    check_command("ppo", ppo(2, ok, one_kv))
    check_command("ppo", ppo(1, nine))  # off: nothing to check
    with pytest.raises(UserError) as e:
        check_command("ppo", ppo(2, ok, nine))
    assert "--reward_pretrain" in str(e.value) and "9 attention heads" in str(e.value)
    assert "sequence_parallel_size 2" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="--pretrain .*does not exist"):
        check_command("ppo", ppo(2, str(tmp_path / "missing")))


def test_rollouts_of_a_group_merge_in_rank_order():
    a = RolloutOutput.from_lists(
        [[5, 6], [5, 6]], [[1], [2, 3]], ["stop", "length"], [[-0.1], [-0.2, -0.3]], pad_id=0, n=2
    )
    b = RolloutOutput.from_lists(
        [[7, 8, 9], [7, 8, 9]], [[4, 4, 4], [5]], ["length", "stop"], [[-1, -1, -1], [-2]],
        pad_id=0, n=2,
    )  # fmt: skip
    out = RolloutOutput.concat([a, b], pad_id=0)
    assert out.finish_reasons == ["stop", "length", "length", "stop"]
    assert out.prompt_ids.tolist() == [[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]
    assert out.prompt_mask[0].tolist() == [0, 1, 1]
    assert out.response_ids.tolist() == [[1, 0, 0], [2, 3, 0], [4, 4, 4], [5, 0, 0]]
    assert out.response_mask.sum(-1).tolist() == [1, 2, 3, 1]
    assert out.engine_logprobs[1].tolist() == pytest.approx([-0.2, -0.3, 0.0])
    assert out.response_attention_mask is None
    assert RolloutOutput.concat([a], pad_id=0) is a


def test_merged_rollouts_keep_each_tokens_routed_experts():
    """Router replay under sequence parallelism: the group's gathered rollouts carry the
    engine's routing, each token's experts staying on their token through the new padding."""
    from dataclasses import replace

    a = RolloutOutput.from_lists([[5, 6]], [[1, 2]], ["stop"], None, pad_id=0, n=1)
    b = RolloutOutput.from_lists([[7, 8, 9]], [[4, 4, 4]], ["length"], None, pad_id=0, n=1)
    # (N, P + T, layers 2, k 3): each token's experts are its column index
    a = replace(a, routed_experts=torch.arange(4).view(1, 4, 1, 1).expand(1, 4, 2, 3).byte())
    b = replace(b, routed_experts=torch.arange(6).view(1, 6, 1, 1).expand(1, 6, 2, 3).byte())
    out = RolloutOutput.concat([a, b], pad_id=0)
    assert out.routed_experts is not None and out.routed_experts.shape == (2, 6, 2, 3)
    assert out.routed_experts[:, :, 0, 0].tolist() == [[255, 0, 1, 2, 3, 255], [0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="with and without routed experts"):
        RolloutOutput.concat([a, replace(b, routed_experts=None)], pad_id=0)


SHAPE_7B = ModelShape.from_hf_config(
    {
        "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008,
        "vocab_size": 152064, "num_attention_heads": 32, "num_key_value_heads": 8,
    }
)  # fmt: skip


def test_activations_per_rank_halve_with_two_ranks_per_sequence():
    f = JobFlags(world=8, device_bytes=80 * GIB, seq_len=32768, response_len=30000)
    one = activation_bytes(f, SHAPE_7B, 1)
    two = activation_bytes(JobFlags(**{**f.__dict__, "sequence_parallel": 2}), SHAPE_7B, 1)
    # half, plus one layer's all-to-all buffers (under 1% here)
    assert 0.5 <= two / one < 0.51
    assert sequence_parallel_options(8, 32, 8) == [1, 2, 4, 8]
    assert sequence_parallel_options(8, 28, 4) == [1, 2, 4]  # 28 heads: not 8
    assert sequence_parallel_options(6, 9, 3) == [1, 3]


def test_the_memory_model_counts_the_attention_masks_that_remain():
    """SDPA keeps an explicit mask for backward (a bias in the compute dtype), whole on every
    rank of a sequence-parallel group; Ulysses' padded rows, packed rows and flash-attn pass
    none (tests/distributed/test_sequence_parallel.py measures what SDPA keeps)."""
    from dataclasses import replace

    s, T = 32768, 30000
    f = JobFlags(
        world=8, device_bytes=80 * GIB, seq_len=s, response_len=T, gradient_checkpointing=True
    )
    # without SP, HF's (1, 1, s, s) mask of padded rows: 2 GiB in bf16, the recomputed layer's
    assert attention_mask_bytes(f, SHAPE_7B, 1, shared_prompts=False) == 2 * s * s == 2 * GIB
    no_ckpt = replace(f, gradient_checkpointing=False)
    assert attention_mask_bytes(no_ckpt, SHAPE_7B, 1, False) == 32 * 2 * GIB  # every layer's
    sp2 = replace(f, sequence_parallel=2)
    assert attention_mask_bytes(sp2, SHAPE_7B, 1, False) == 0  # causal kernels row by row
    # shared-prompt rows (8 samples a prompt): the prompt's mask once, each response's whole
    shared = replace(sp2, shared_prompts=8)
    P = s - T
    assert attention_mask_bytes(shared, SHAPE_7B, 8, True) == 2 * (P * P + 8 * T * s)
    assert attention_mask_bytes(shared, SHAPE_7B, 8, False) == 0  # the critic's padded rows
    assert attention_mask_bytes(replace(shared, packing=True), SHAPE_7B, 8, True) == 0
    assert attention_mask_bytes(replace(shared, flash_attn=True), SHAPE_7B, 8, True) == 0
    phases = {p.name: p for p in plan_phases(replace(shared, micro_train_batch_size=8),
                                             SHAPE_7B, SHAPE_7B, [SHAPE_7B])}  # fmt: skip
    assert phases["actor update"].parts["attention masks"] == 2 * (P * P + 8 * T * s)
    assert "attention masks" not in phases["critic update"].parts


def test_the_model_names_the_smallest_split_that_fits():
    f = JobFlags(
        world=8, device_bytes=80 * GIB, seq_len=65536, response_len=64000, adam_offload=True,
        gradient_checkpointing=True, critic=False,
    )  # fmt: skip
    frozen = [SHAPE_7B]
    assert not all(p.fits for p in plan_phases(f, SHAPE_7B, None, frozen))
    n, phases = sequence_parallel_needed(f, SHAPE_7B, None, frozen, [1, 2, 4, 8])
    assert n is not None and n > 1 and all(p.fits for p in phases)
    smaller = JobFlags(**{**f.__dict__, "sequence_parallel": n // 2})
    assert not all(p.fits for p in plan_phases(smaller, SHAPE_7B, None, frozen))
    tiny = JobFlags(**{**f.__dict__, "device_bytes": 8 * GIB})
    assert sequence_parallel_needed(tiny, SHAPE_7B, None, frozen, [1, 2])[0] is None


def _ppo(model: str, *argv: str) -> PPOConfig:
    base = ["--pretrain", model, "--remote_rm_url", "r.py", "--prompt_data", "p.jsonl"]
    return build_config(PPOConfig, [*base, *argv])[0]


def test_long_generation_must_fit_the_model_context(tmp_path):
    from fsdp_rlhf.trainers.ppo.setup import check_context_length

    short = _config_only(tmp_path / "short", 2, 2, max_position_embeddings=4096)
    long = _config_only(tmp_path / "long", 2, 2, max_position_embeddings=40960)
    scaled = _config_only(
        tmp_path / "yarn", 2, 2, max_position_embeddings=8192,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    lengths = ("--prompt_max_len", "1024", "--generate_max_len", "32768")
    check_context_length(_ppo(long, *lengths))
    check_context_length(_ppo(scaled, *lengths))
    with pytest.raises(UserError) as e:
        check_context_length(_ppo(short, *lengths))
    assert "33792 tokens" in str(e.value) and "4096" in str(e.value)
    assert "--prompt_max_len + --generate_max_len" in str(e.value)
    with pytest.raises(UserError, match="--max_len = 5000 tokens"):
        check_context_length(_ppo(short, *lengths, "--max_len", "5000"))
    check_context_length(_ppo(short, *lengths, "--rollout_engine", "hf"))  # HF: no vLLM limit


def test_row_spans_are_each_rows_run_of_tokens_or_none():
    from fsdp_rlhf.models.attention import row_spans, span_attention

    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert row_spans(mask) == ((1, 3), (0, 4), (0, 0))
    assert row_spans(torch.tensor([[1, 0, 1, 1]])) is None  # a hole: the masked kernel
    q = torch.randn(3, 2, 4, 8)
    out = span_attention(q, q, q, row_spans(mask), 0.0, 0.5)
    assert out.shape == q.shape and out[2].abs().sum() == 0 and out[0, :, 0].abs().sum() == 0
    ref = torch.nn.functional.scaled_dot_product_attention(q[0:1, :, 1:3], q[0:1, :, 1:3],
                                                           q[0:1, :, 1:3], is_causal=True,
                                                           scale=0.5)  # fmt: skip
    torch.testing.assert_close(out[0:1, :, 1:3], ref)


@pytest.mark.parametrize("grad", [False, True])  # SDPA, the explicit CPU kernel
@pytest.mark.parametrize("spans", [False, True])  # with each row's run of tokens: no mask
def test_the_inner_kernel_of_padded_rows_keeps_sliding_windows(tmp_path, grad, spans):
    """Inside Ulysses a padded row's attention runs on the whole row (models.ulysses
    _inner_attention); Gemma 3's sliding-window layers (window 16) must see their last 16
    keys there as in transformers' own padded forward, and its global layers take SDPA's
    causal kernel row by row when the rows' runs are known. Run here on one rank: the kernel
    the all-to-alls wrap, fed the whole row."""
    import torch
    from transformers import AttentionInterface

    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.attention import row_spans
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.ulysses import UlyssesContext, _inner_attention
    from fsdp_rlhf.testing.tiny import build_family

    def inner(module, q, k, v, attention_mask, dropout=0.0, scaling=None, **kwargs):
        sp = kwargs.pop("sequence_parallel")
        return _inner_attention(module, q, k, v, None, dropout, scaling, sp, kwargs), None

    AttentionInterface.register("test_ulysses_inner", inner)
    model = load_causal_lm(str(build_family(tmp_path, "gemma3")), BackendConfig(), "cpu")
    assert model.config.sliding_window == 16
    torch.manual_seed(0)
    ids = torch.randint(5, 200, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    mask[0, 33:] = 0  # right padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.set_grad_enabled(grad):
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=mask, position_ids=pos).logits
        model.set_attn_implementation("test_ulysses_inner")
        runs = row_spans(mask) if spans else None
        assert runs is None or runs == ((0, 33), (9, 40))
        ctx = UlyssesContext(None, 1, ids.shape[1], "sdpa", mask.bool(), runs)
        got = model(ids, position_ids=pos, sequence_parallel=ctx).logits
    on = mask.bool()
    torch.testing.assert_close(got[on], ref[on], rtol=1e-4, atol=1e-4)


def _fake_flash_attn(monkeypatch) -> None:
    """flash-attn's Python API (``flash_attn_func``, ``flash_attn_varlen_func``, ``bert_padding``)
    computed per sequence with SDPA, installed where transformers looks for flash-attn 2: the
    kernel transformers picks by name can then run on CPU."""
    import sys
    import types

    import torch
    import torch.nn.functional as F
    import transformers.modeling_flash_attention_utils as fa

    def attend(q, k, v, causal, scale):  # one sequence: (L, H, D), k/v (L, KV, D)
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, deterministic=False):  # fmt: skip
        return torch.stack([attend(q[i], k[i], v[i], causal, softmax_scale) for i in range(len(q))])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, deterministic=False):  # fmt: skip
        bounds = cu_seqlens_q.tolist()
        return torch.cat([
            attend(q[a:b], k[a:b], v[a:b], causal, softmax_scale)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ])  # fmt: skip

    flash = types.ModuleType("flash_attn")
    flash.flash_attn_func, flash.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    flash.flash_attn_with_kvcache = None
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = fa._pad_input, fa._unpad_input
    flash.bert_padding = padding
    monkeypatch.setitem(sys.modules, "flash_attn", flash)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", padding)
    monkeypatch.setattr(fa, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(fa, "_loaded_implementation", None)


def test_the_flash_kernel_inside_ulysses_is_found_by_its_own_name(tmp_path, monkeypatch):
    """Issue #45, finding 1: inside Ulysses the model's attention implementation is
    ``fsdp_rlhf_ulysses``; transformers' flash wrapper looked its kernel up by that name and
    raised "Could not find the currently requested flash attention implementation". The inner
    kernel is set as ``models.load`` sets it on CUDA with --flash_attn (flash-attn emulated by
    SDPA here); padded rows with left padding and rows without padding, with gradients."""
    import torch
    from transformers import AttentionInterface

    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.attention import FLASH_ATTENTION
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.ulysses import ULYSSES_ATTENTION, UlyssesContext, _inner_attention
    from fsdp_rlhf.testing.tiny import build_model

    _fake_flash_attn(monkeypatch)

    def inner(module, q, k, v, attention_mask, dropout=0.0, scaling=None, **kwargs):
        sp = kwargs.pop("sequence_parallel")
        return _inner_attention(module, q, k, v, None, dropout, scaling, sp, kwargs), None

    # the name the wrapper used to look its kernel up by (restored after the test)
    monkeypatch.setitem(AttentionInterface._global_mapping, ULYSSES_ATTENTION, inner)
    path = build_model(tmp_path, "qwen2", hidden_size=96, num_heads=3, num_kv_heads=1,
                       intermediate_size=64, num_layers=2, vocab_size=300)  # fmt: skip
    model = load_causal_lm(str(path), BackendConfig(), "cpu")
    torch.manual_seed(0)
    ids = torch.randint(5, 200, (2, 24))
    for padded in (True, False):
        mask = torch.ones_like(ids)
        if padded:
            mask[1, :7] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=mask, position_ids=pos).logits
        model.set_attn_implementation(ULYSSES_ATTENTION)
        padding = mask.bool() if padded else None
        ctx = UlyssesContext(None, 1, ids.shape[1], FLASH_ATTENTION, padding)
        got = model(ids, position_ids=pos, sequence_parallel=ctx).logits
        on = mask.bool()
        torch.testing.assert_close(got[on], ref[on], rtol=1e-4, atol=1e-4)
        got[on].sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        model.zero_grad()
