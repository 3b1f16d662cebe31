"""The pieces of on-policy distillation around the algorithms: the memory model counts the
teacher, the tokenizer comparison names what differs, the served teacher's answers are read at
the right positions, the advantage signal joins the advantages and keeps the old log-probs
before the update."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.config_base import build_config
from fsdp_rlhf.distributed.memory import GIB, JobFlags, ModelShape, plan_phases
from fsdp_rlhf.trainers.experience import Experience
from fsdp_rlhf.trainers.ppo.rewards import add_distill_advantages
from fsdp_rlhf.trainers.ppo.served_teacher import (
    _read_choice,
    response_positions,
    sequences_of,
)
from fsdp_rlhf.trainers.ppo.update import reuse_update_logprobs


def _shape(params: int, hidden: int) -> ModelShape:
    return ModelShape(
        params=params, layers=28, hidden=hidden, intermediate=4 * hidden, vocab=152064
    )


def test_the_memory_model_counts_the_teacher_resident_or_onloaded():
    flags = JobFlags(world=8, device_bytes=80 * GIB, micro_train_batch_size=2)
    actor, teacher = _shape(1_500_000_000, 1536), _shape(7_000_000_000, 3584)
    plain = {p.name: p for p in plan_phases(flags, actor, None, [actor])}
    with_teacher = {p.name: p for p in plan_phases(flags, actor, None, [actor], teacher)}
    shard = 2 * teacher.params // 8  # bf16 shards over 8 ranks
    for name, phase in with_teacher.items():
        assert phase.parts.get("teacher shard") == shard, name
        assert phase.total >= plain[name].total + shard
    offloaded = dataclasses.replace(flags, teacher_offload=True)
    phases = {p.name: p for p in plan_phases(offloaded, actor, None, [actor], teacher)}
    assert all("teacher shard" not in p.parts for p in phases.values())
    assert phases["scoring (no-grad)"].parts["teacher shard (onloaded)"] == shard
    # the scoring pass gathers the largest model's layer: the teacher's
    assert (
        phases["scoring (no-grad)"].parts["gathered layer + root"]
        > plain["scoring (no-grad)"].parts["gathered layer + root"]
    )


def test_tokenizer_difference_names_the_first_difference(tmp_path):
    from fsdp_rlhf.models.load import load_tokenizer
    from fsdp_rlhf.models.tokenizer_match import tokenizer_difference
    from fsdp_rlhf.testing.tiny import SPECIAL_TOKENS, build_tokenizer

    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")  # the same training: the same ids
    build_tokenizer(tmp_path / "c", special_tokens=[*SPECIAL_TOKENS, "<|tool|>"])
    a, b, c = (load_tokenizer(str(tmp_path / n)) for n in "abc")
    assert tokenizer_difference(a, b) is None
    found = tokenizer_difference(a, c)
    assert found is not None and ("<|tool|>" in found or "vocabulary" in found or "id" in found)


def test_served_answers_are_read_at_the_response_positions():
    # two rows: prompts left-padded to 3, responses right-padded to 3 (pad 0)
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [4, 5, 6, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert sequences_of(ids, mask) == [[5, 6, 7, 8], [4, 5, 6, 9, 10, 11]]
    pos = response_positions(mask, 3)
    # row 0's response tokens 7, 8 are its 3rd and 4th tokens; its padding is -1
    assert pos.tolist() == [[2, 3, -1], [3, 4, 5]]
    # vLLM's prompt_logprobs: None for the first token, then {id: {logprob, rank}} per token
    entries = [
        None,
        {"6": {"logprob": -1.0, "rank": 2}, "9": {"logprob": -0.5, "rank": 1}},
        {"7": {"logprob": -2.0, "rank": 3}, "1": {"logprob": -0.1, "rank": 1},
         "2": {"logprob": -0.7, "rank": 2}},
        {"8": {"logprob": -0.3, "rank": 1}, "3": {"logprob": -1.9, "rank": 2}},
    ]  # fmt: skip
    logprobs, tops = _read_choice(entries, [5, 6, 7, 8], topk=2)
    assert logprobs == [-1.0, -2.0, -0.3]  # token i + 1's log-prob at entry i
    assert tops[1] == [(1, -0.1), (2, -0.7)]  # ranked, the sampled token (rank 3) left out
    assert tops[2] == [(8, -0.3), (3, -1.9)]
    with pytest.raises(ValueError, match="4 prompt log-probs for 3 tokens"):
        _read_choice(entries, [5, 6, 7], topk=0)


def _exp() -> Experience:
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    exp = Experience(torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5), mask, mask * 0)
    exp.old_logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    exp.teacher_logprobs = torch.tensor([[-0.5, -4.0, 0.0]])
    exp.advantages = torch.tensor([[0.25, 0.25, 0.0]])
    return exp


def test_the_advantage_signal_joins_the_task_advantages():
    cfg, _ = build_config(PPOConfig, ["--teacher_url", "http://t", "--distill_coef", "2"])
    exp = _exp()
    add_distill_advantages(exp, cfg.distill)
    # 0.25 - 2 * (-1 + 0.5), 0.25 - 2 * (-2 + 4), masked: 0
    assert exp.advantages.tolist() == [[1.25, -3.75, 0.0]]
    k3, _ = build_config(PPOConfig, ["--teacher_url", "http://t", "--distill_loss", "k3"])
    exp = _exp()
    add_distill_advantages(exp, k3.distill)  # a loss term: the advantages stay
    assert exp.advantages.tolist() == [[0.25, 0.25, 0.0]]


def test_the_advantage_signal_needs_the_old_log_probs_before_the_update():
    argv = ["--init_kl_coef", "0", "--teacher_url", "http://t"]
    cfg, _ = build_config(PPOConfig, argv)
    assert not reuse_update_logprobs(cfg.algo, 1, True, cfg.distill)
    cfg, _ = build_config(PPOConfig, [*argv, "--distill_loss", "k3"])
    assert reuse_update_logprobs(cfg.algo, 1, True, cfg.distill)
    assert reuse_update_logprobs(cfg.algo, 1, True)


def test_served_scores_land_on_the_response_tokens():
    """``Teacher`` with a served teacher: each answer's entries go to the response columns
    they predict, nothing to padding; the top-k rows padded with no mass."""
    from fsdp_rlhf.trainers.ppo.teacher import Teacher

    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [4, 5, 6, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    response = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    exp = Experience(ids, mask, response, torch.zeros(2, 3))

    class Server:
        def score(self, sequences, topk):
            assert sequences == [[5, 6, 7, 8], [4, 5, 6, 9, 10, 11]] and topk == 2
            out = []
            for seq in sequences:
                lps = [-float(t) / 10 for t in seq[1:]]  # token t: -t / 10
                tops = [[(t, -0.01)] for t in seq[1:]]  # one entry: the second is padding
                out.append((lps, tops))
            return out

    teacher = Teacher.__new__(Teacher)
    teacher.served, teacher.topk, teacher.student_vocab = Server(), 2, 11  # id 11: outside
    teacher.score(exp, 4)
    assert torch.allclose(
        exp.teacher_logprobs, torch.tensor([[-0.7, -0.8, 0.0], [-0.9, -1.0, -1.1]])
    )
    assert exp.teacher_topk_ids[1, :, 0].tolist() == [9, 10, 0]
    assert exp.teacher_topk_logprobs[1, 2, 0] == -1e4  # a row the student lacks: no mass
    assert exp.teacher_topk_logprobs[0, 0].tolist() == pytest.approx([-0.01, -1e4])


def test_the_job_plan_reads_the_teachers_shape(tiny_qwen2, tiny_llama):
    """``doctor``'s memory plan: the teacher's folder read like the actor's, its shard in
    every phase (offloaded: in the scoring phase only)."""
    from fsdp_rlhf.distributed.memory_plan import job_flags, job_models, plan_job

    argv = ["--pretrain", tiny_qwen2, "--teacher_pretrain", tiny_llama]
    cfg, _ = build_config(PPOConfig, argv)
    models = job_models(cfg, job_flags(cfg, 2, 8 * GIB))
    assert models.teacher is not None and models.teacher.hidden == 576  # the Llama's
    phases = plan_job(cfg, 2, 8 * GIB, cuda=False)
    assert all("teacher shard" in p.parts for p in phases)
    cfg, _ = build_config(PPOConfig, [*argv, "--teacher_offload"])
    phases = {p.name: p for p in plan_job(cfg, 2, 8 * GIB, cuda=False)}
    assert "teacher shard (onloaded)" in phases["scoring (no-grad)"].parts
