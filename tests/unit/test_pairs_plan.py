"""The pairwise matrix's plan (fsdp_rlhf.rules.pairs): every pair of the eight features is
either refused by a row that fires on the pair's flags or run by a job whose flags no row
refuses; deleting a row moves its pairs into the jobs (the plan reads the table, it holds no
list of refusals)."""

from __future__ import annotations

from fsdp_rlhf.rules.pairs import NAMES, PAIRS, first_refusal, plan
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


def test_a_deleted_row_moves_its_pairs_into_the_jobs():
    before = plan()
    assert ("VLM", "packing") in before.refused
    lifted = [r for r in RULES if r.id != "vlm-packing"]
    after = plan(lifted)
    assert ("VLM", "packing") not in after.refused
    job = after.cell("packing", "VLM")
    assert job.model == "vlm" and "--packing_samples" in job.argv and "--image_key" in job.argv
    # router replay on a VLM needs the hybrid MoE VLM, which runs in bf16 on CPU
    vlm_moe = plan([r for r in RULES if r.id not in ("vlm-router-replay",)])
    job = vlm_moe.cell("VLM", "router replay")
    assert job.model == "vlm_moe" and "--bf16" in job.argv


def test_lora_takes_merged_sync_where_adapters_are_refused():
    """vLLM's LoRA MoE layers need Triton: on CPU an MoE job syncs LoRA merged, a dense job
    serves adapters."""
    for job in plan().jobs:
        if "LoRA" in job.features:
            merged = "--lora_sync" in job.argv
            assert merged == (job.model == "moe"), job
    assert set(NAMES) >= {f for job in plan().jobs for f in job.features}
