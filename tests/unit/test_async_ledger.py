"""The asynchronous run's ledger: what it reads back after kills and resumes."""

from __future__ import annotations

from fsdp_rlhf.trainers.ppo.async_ledger import (
    TRAIN,
    LedgerWriter,
    attempts,
    generated_after,
    read,
    rollout_file,
    trained,
)


def test_a_resume_voids_what_earlier_attempts_trained_after_its_checkpoint(tmp_path):
    first = LedgerWriter(tmp_path, TRAIN, attempt=1)
    first.record("start", step=0, regenerated=[])
    for step in (1, 2, 3):  # step 3 trained, killed before its checkpoint
        first.record("trained", step=step, prompts=[2 * step, 2 * step + 1], samples=[4, 4])
    first.close()
    second = LedgerWriter(tmp_path, TRAIN, attempt=2)
    second.record("start", step=2, regenerated=[3, 4])
    second.record("trained", step=3, prompts=[6, 7], samples=[4, 4])
    second.close()
    assert trained(tmp_path) == {1: {2: 4, 3: 4}, 2: {4: 4, 5: 4}, 3: {6: 4, 7: 4}}
    assert attempts(tmp_path) == 2
    # a resume from step 1 after that drops steps 2 and 3 again
    third = LedgerWriter(tmp_path, TRAIN, attempt=3)
    third.record("start", step=1, regenerated=[])
    third.close()
    assert trained(tmp_path) == {1: {2: 4, 3: 4}}


def test_a_torn_last_line_is_skipped(tmp_path):
    ledger = LedgerWriter(tmp_path, rollout_file(1), attempt=1)
    ledger.record("generated", batch=4, prompts=[1], samples=[2], dropped=[], versions=[2, 2])
    ledger.close()
    with open(tmp_path / rollout_file(1), "a") as f:
        f.write('{"event": "generated", "batch": 5, "pro')  # killed mid-write
    assert [r["batch"] for r in read(tmp_path / rollout_file(1))] == [4]
    assert generated_after(tmp_path, 3) == [4] and generated_after(tmp_path, 4) == []
    assert read(tmp_path / "missing.jsonl") == [] and trained(tmp_path) == {}
