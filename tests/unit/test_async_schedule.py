"""Asynchronous training's arithmetic: who generates and who trains which prompts, the
staleness bound, the messages between the sides, the split of the world, and the
refusals before any model loads."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.config import PPOConfig, plan_ppo_batches
from fsdp_rlhf.config_base import ConfigError, build_config
from fsdp_rlhf.distributed.bridge import from_bytes, to_bytes
from fsdp_rlhf.distributed.split_world import SplitWorld
from fsdp_rlhf.models.vision import ImageBatch, ImageInputs
from fsdp_rlhf.trainers.experience import Experience
from fsdp_rlhf.trainers.ppo.async_queue import (
    BatchPart,
    needed_version,
    reports_to,
    routes,
    staleness,
)
from fsdp_rlhf.trainers.ppo.dynamic_filtering import concat_experiences
from fsdp_rlhf.trainers.ppo.metrics import StatCollector


@pytest.mark.parametrize(
    ("prompts", "rollout", "training"), [(16, 1, 1), (16, 2, 4), (12, 4, 3), (24, 6, 4)]
)
def test_routes_cover_every_prompt_once_in_order(prompts, rollout, training):
    table = routes(prompts, rollout, training)
    covered = [i for r in table for i in range(r.start, r.stop)]
    assert covered == list(range(prompts))
    for r in table:
        assert r.source == r.start // (prompts // rollout) == (r.stop - 1) // (prompts // rollout)
        assert r.dest == r.start // (prompts // training) == (r.stop - 1) // (prompts // training)
    # each training rank receives its prompts in order, from the rollout ranks in order
    for dest in range(training):
        mine = [i for r in table if r.dest == dest for i in range(r.start, r.stop)]
        assert mine == list(range(dest * prompts // training, (dest + 1) * prompts // training))
    # every rollout rank's statistics are counted by exactly one training rank it sends to
    for source in range(rollout):
        assert reports_to(source, table) in {r.dest for r in table if r.source == source}


def test_staleness_bound():
    # batch j may be generated with weights of version j - 1 - K at the oldest
    assert [needed_version(j, 1) for j in (1, 2, 3)] == [-1, 0, 1]
    assert needed_version(5, 2) == 2


def test_staleness_per_token_and_mixed_responses():
    versions = torch.tensor([[3, 3, 4, 4], [4, 4, 4, -1], [2, 2, -1, -1]])
    mask = (versions >= 0).float()
    exp = Experience(
        input_ids=torch.zeros(3, 6, dtype=torch.long),
        attention_mask=torch.ones(3, 6, dtype=torch.long),
        response_mask=mask,
        engine_logprobs=torch.zeros(3, 4),
        token_versions=versions,
    )
    s = staleness(exp, trained_version=4)
    assert s["lag"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [2, 2, 0, 0]]
    assert s["mixed"].tolist() == [1.0, 0.0, 0.0]  # only row 0 spans two versions


def test_a_batch_part_survives_the_wire():
    exp = Experience(
        input_ids=torch.arange(12).reshape(2, 6),
        attention_mask=torch.ones(2, 6, dtype=torch.long),
        response_mask=torch.tensor([[1.0, 1, 0], [1, 1, 1]]),
        engine_logprobs=torch.tensor([[-1.0, -2, 0], [-0.5, -0.25, -3]]),
        truncated=torch.tensor([False, True]),
        token_versions=torch.tensor([[0, 1, -1], [1, 1, 1]]),
        scores=torch.tensor([0.5, 1.0]),
    )
    stats = StatCollector()
    stats.add("x", torch.tensor([1.0, 3.0]))
    part = BatchPart(7, exp, [11, 5], {"epoch": 1, "index": 2}, {"stats": stats.export()})
    back = BatchPart.from_message(from_bytes(to_bytes(part.to_message())), torch.device("cpu"))
    assert (back.batch, back.prompts, back.sampler) == (7, [11, 5], {"epoch": 1, "index": 2})
    for name in ("input_ids", "response_mask", "engine_logprobs", "token_versions", "scores"):
        assert torch.equal(getattr(back.rows, name), getattr(exp, name)), name
    assert back.rows.old_logprobs is None and back.report["stats"]["means"] == []


def _image_inputs(seed: int, grids: list[list[int]]) -> ImageInputs:
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grids)
    return ImageInputs(torch.randn(int(grid.prod(-1).sum()), 12, generator=g), grid)


def test_a_vlm_batch_keeps_its_images_across_the_wire():
    """A rollout rank's rows of 3 prompts x 2 samples (2 images, none, 1 image), sent over
    two routes and joined again on the training rank: every row gets its own prompt's pixel
    values and grids back (the forward's pixel_values, image_grid_thw, and so the M-RoPE
    positions built from them), each prompt's images travel once for its samples, and the
    samples of one prompt share them again."""
    n = 2
    per_prompt = [_image_inputs(0, [[1, 4, 4], [1, 2, 6]]), None, _image_inputs(1, [[1, 6, 2]])]
    images = ImageBatch.repeat(per_prompt, n)
    exp = Experience(
        input_ids=torch.arange(36).reshape(6, 6),
        attention_mask=torch.ones(6, 6, dtype=torch.long),
        response_mask=torch.ones(6, 3),
        engine_logprobs=-torch.rand(6, 3),
        token_versions=torch.zeros(6, 3, dtype=torch.long),
        images=images,
    )
    back = []
    for rows in (torch.arange(0, 2), torch.arange(2, 6)):  # two routes: prompt 0; prompts 1-2
        part = BatchPart(3, exp.rows(rows), [0], {"epoch": 0, "index": 0})
        message = from_bytes(to_bytes(part.to_message()))
        sent = message["rows"]["images"]
        assert len(sent["pixel_values"]) == len({id(r) for r in part.rows.images.rows if r})
        back.append(BatchPart.from_message(message, torch.device("cpu")).rows)
    joined = concat_experiences(back, pad_id=0)
    assert [r is None for r in joined.images.rows] == [r is None for r in images.rows]
    cpu = torch.device("cpu")
    want, got = images.model_kwargs(cpu), joined.images.model_kwargs(cpu)
    assert want.keys() == got.keys() == {"pixel_values", "image_grid_thw"}
    for key in want:
        assert torch.equal(want[key], got[key]), key
    for i in range(len(per_prompt)):  # a prompt's samples share one copy again
        assert joined.images.rows[i * n] is joined.images.rows[i * n + 1]
    assert joined.images.nbytes == images.nbytes
    assert torch.equal(joined.input_ids, exp.input_ids)


def test_stat_collectors_merge_across_processes():
    a, b, whole = StatCollector(), StatCollector(), StatCollector()
    a.add("len", torch.tensor([1.0, 2.0]))
    a.add_mean("clip", torch.tensor([1.0, 0.0]))
    a.add_max("lag", torch.tensor(1.0))
    b.add("len", torch.tensor([6.0]))
    b.add_mean("clip", torch.tensor([1.0]))
    b.add_max("lag", torch.tensor(3.0))
    whole.merge(a.export())
    whole.merge(b.export())
    out = whole.reduce()
    assert out["len/mean"] == 3.0 and out["len/max"] == 6.0 and out["len/min"] == 1.0
    assert out["clip"] == pytest.approx(2 / 3) and out["lag"] == 3.0


def test_split_world_roles():
    split = SplitWorld(world_size=8, rollout_ranks=4, tp_size=2)
    assert split.training_ranks == 4 and split.num_engines == 2
    assert [split.is_rollout(r) for r in range(8)] == [False] * 4 + [True] * 4
    assert split.engine_ranks(1) == [6, 7] and split.engine(5) == 0
    assert split.group_of(2) == ("train", 2, 4)
    assert split.group_of(7) == ("engine1", 1, 2)
    assert split.describe(6) == "rollout rank 6 (engine 1)"
    assert split.blocks_crossing_nodes(8) == [] and split.engines_per_node(8) == 2
    # 3 training ranks + 2 engines of 2 on nodes of 4: engine 0 is ranks 3 and 4
    assert SplitWorld(7, 4, 2).blocks_crossing_nodes(4) == [0]
    with pytest.raises(ValueError):
        SplitWorld(4, 4, 1)


def _cfg(*argv: str) -> PPOConfig:
    return build_config(PPOConfig, ["--pretrain", "m", *argv])[0]


def test_async_batch_plan_is_the_training_ranks():
    cfg = _cfg(
        *("--async_train", "--vllm_num_engines", "2", "--rollout_batch_size", "8"),
        *("--n_samples_per_prompt", "4", "--train_batch_size", "16"),
        *("--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4"),
    )
    plan = plan_ppo_batches(cfg, 4)  # 2 rollout ranks, 2 training ranks
    assert (plan.world_size, plan.rollout_ranks, plan.num_engines) == (2, 2, 2)
    assert plan.dp_size == 2  # the training ranks hold the data, not the world
    assert plan.train_batch_size_per_rank == 8 and plan.optimizer_steps_per_epoch == 2


@pytest.mark.parametrize(
    ("argv", "world", "words"),
    [
        ((), 2, "needs --vllm_num_engines"),
        (("--vllm_num_engines", "2"), 2, "leave no training rank"),
        (("--vllm_num_engines", "3", "--rollout_batch_size", "8"), 4, "divisible by the 3"),
        (
            ("--vllm_num_engines", "1", "--vllm_generate_batch_size", "4"),
            2,
            "must be >= rollout_batch_size",
        ),
    ],
)
def test_async_placements_that_cannot_be_honoured(argv, world, words):
    cfg = _cfg("--async_train", "--rollout_batch_size", "8", *argv)
    with pytest.raises(ConfigError, match=words):
        plan_ppo_batches(cfg, world)


def test_async_only_flags_need_async_train():
    from fsdp_rlhf.rules import Refused, check_flags

    for flag in (["--partial_rollout"], ["--async_queue_size", "2"]):
        with pytest.raises(Refused, match="add --async_train"):
            check_flags("ppo", _cfg(*flag))
    with pytest.raises(ConfigError, match="async_queue_size must be >= 1"):
        _cfg("--async_train", "--async_queue_size", "0")


def test_sequence_parallelism_runs_with_async_train():
    """The training ranks form sequence-parallel groups; routes end at data-parallel ranks and
    reach every rank of a group (#48)."""
    from fsdp_rlhf.rules import check_flags
    from fsdp_rlhf.trainers.ppo.async_queue import route_ranks

    sp = ("--async_train", "--vllm_num_engines", "1", "--sequence_parallel_size", "2")
    check_flags("ppo", _cfg(*sp, "--advantage_estimator", "grpo", "--n_samples_per_prompt", "4"))
    table = routes(8, 2, 2)  # 8 prompts, 2 rollout ranks, 4 training ranks at SP 2
    assert [(r.source, r.dest, r.start, r.stop) for r in table] == [(0, 0, 0, 4), (1, 1, 4, 8)]
    assert [list(route_ranks(r.dest, 2)) for r in table] == [[0, 1], [2, 3]]
    assert list(route_ranks(1, 1)) == [1]


def test_expert_parallelism_runs_with_async_train():
    """The expert groups are built over the training ranks (a rollout rank's layout has none):
    the async-expert-parallel row is gone (#48)."""
    from fsdp_rlhf.rules import check_flags

    ep = ("--async_train", "--vllm_num_engines", "1", "--expert_parallel_size", "2")
    check_flags("ppo", _cfg(*ep, "--advantage_estimator", "grpo", "--n_samples_per_prompt", "4"))


def test_statistics_held_by_one_rank_are_reduced_under_the_same_names_on_every_rank():
    """A rollout rank's report reaches one training rank: after include(), the other holds
    the same names with values that change no sum, max or min."""
    with_report, without = StatCollector(), StatCollector()
    for stats in (with_report, without):
        stats.add("response_length", torch.tensor([3.0, 5.0]))
    rollout = StatCollector()
    rollout.add("rollout/engine_length", torch.tensor([7.0]))
    rollout.add_max("rollout/peak", torch.tensor(2.0))
    rollout.add_mean("rollout/frac", torch.tensor([0.5, 1.0]))
    with_report.merge(rollout.export())
    names = [with_report.names(), without.names()]
    for stats in (with_report, without):
        for other in names:
            stats.include(other)
    assert with_report.names() == without.names()
    assert without.sums["rollout/engine_length/sum"] == 0.0
    assert without.maxs["rollout/engine_length"] == float("-inf")
    assert without.mins["rollout/engine_length"] == float("inf")
    assert without.only_maxs["rollout/peak"] == float("-inf")
    # the reporting rank's own values are untouched
    assert float(with_report.sums["rollout/engine_length/sum"]) == 7.0
    assert with_report.reduce()["rollout/frac"] == 0.75
