"""Preference data: sources and mixing, rendering and tokenizing, batching, bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from fsdp_rlhf.config import PreferenceDataConfig
from fsdp_rlhf.data.preference import (
    PreferenceLoader,
    collate_pairs,
    finish_ids,
    hold_out,
    tokenize_pairs,
)
from fsdp_rlhf.data.schedule import DataPosition, StepSchedule, eval_shard
from fsdp_rlhf.data.sources import check_keys, load_sources
from fsdp_rlhf.errors import UserError

ROWS = [{"chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from fsdp_rlhf.testing.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _load(spec: str, probs: str | None = "1", **kw) -> datasets.Dataset:
    return load_sources(
        spec, probs, max_samples=kw.pop("max_samples", 10**6), seed=0, flag_name="--dataset", **kw
    )


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------- sources


def test_every_source_format_reads_the_same_rows(tmp_path):
    jsonl = _jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "array.json").write_text(json.dumps(ROWS, indent=1))
    lines_json = tmp_path / "lines.json"  # JSON Lines under a .json name, common in the wild
    lines_json.write_text(Path(jsonl).read_text())
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "a.parquet"))
    folder = tmp_path / "folder"
    folder.mkdir()
    _jsonl(folder / "part1.jsonl", ROWS[:3])
    _jsonl(folder / "part2.jsonl", ROWS[3:])
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "disk"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(
        str(tmp_path / "disk_dict")
    )
    for name in ("a.jsonl", "array.json", "lines.json", "a.parquet", "folder", "disk", "disk_dict"):
        ds = _load(str(tmp_path / name))
        assert sorted(ds["chosen"]) == sorted(r["chosen"] for r in ROWS), name


def test_mixing_with_probs_exhausts_every_source(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"chosen": f"a{i}", "rejected": "x"} for i in range(10)])
    b = _jsonl(tmp_path / "b.jsonl", [{"chosen": f"b{i}", "rejected": "x"} for i in range(3)])
    mixed = _load(f"{a}, {b}", "0.5,0.5")
    assert {f"a{i}" for i in range(10)} | {f"b{i}" for i in range(3)} <= set(mixed["chosen"])
    assert mixed["chosen"] == _load(f"{a},{b}", "0.5,0.5")["chosen"]  # seeded
    assert len(_load(f"{a},{b}", "0.5,0.5", max_samples=4)) == 4
    assert len(_load(f"{a},{b}", None)) == 13  # eval sets: plain concatenation


def test_columns_are_checked_and_selected_per_source(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"chosen": "c", "rejected": "r", "extra": 1}])
    b = _jsonl(tmp_path / "b.jsonl", [{"chosen": "c", "rejected": "r", "other": "z"}])
    cols = {"--chosen_key": "chosen", "--rejected_key": "rejected"}
    mixed = _load(f"{a},{b}", "0.5,0.5", columns=cols)
    assert mixed.column_names == ["chosen", "rejected"]
    with pytest.raises(
        UserError, match=r"--prompt_key 'prompt'.*b\.jsonl.*chosen, rejected, other"
    ):
        _load(b, columns={**cols, "--prompt_key": "prompt"})
    with pytest.raises(UserError, match=r"--chosen_key 'answer'.*available keys: chosen"):
        check_keys(datasets.Dataset.from_list(ROWS), ["answer"], ["--chosen_key"])


@pytest.mark.parametrize(
    ("probs", "pattern"),
    [
        ("1", r"--dataset_probs has 1 value\(s\) .* 2 source\(s\)"),
        ("0.5,0.2", r"--dataset_probs 0.5,0.2: probabilities must sum to 1"),
        ("0.5,x", r"--dataset_probs '0.5,x': expected comma-separated numbers"),
        ("1.5,-0.5", r"must be finite and >= 0"),
    ],
)
def test_bad_probs(tmp_path, probs, pattern):
    a = _jsonl(tmp_path / "a.jsonl", ROWS)
    with pytest.raises(UserError, match=pattern):
        _load(f"{a},{a}", probs)


def test_missing_paths_and_unreadable_sources(tmp_path):
    with pytest.raises(UserError, match=r"^--dataset .*nope\.jsonl: no such file or folder$"):
        _load(str(tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match=r"^--dataset \./rel/dir: no such file or folder$"):
        _load("./rel/dir")
    with pytest.raises(UserError, match="not a local path; loading it from the Hub failed"):
        _load("no-such-org-fsdp-rlhf/no-such-dataset")  # tests run with HF_HUB_OFFLINE=1
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty: no \.json/\.jsonl/\.parquet data found"):
        _load(str(tmp_path / "empty"))
    with pytest.raises(UserError, match="--dataset is required"):
        _load(" , ")


def test_malformed_json_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chosen": "a", "rejected": "b"}\n\n{"chosen": "a", "rejected": \n')
    with pytest.raises(UserError, match=rf"^{bad}:3: malformed JSON line"):
        _load(str(bad))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "x.json").write_text('[\n  {"chosen": "a",\n   "rejected": }\n]')
    with pytest.raises(UserError, match=r"x\.json:3: malformed JSON"):
        _load(str(folder))


# ---------------------------------------------------------------- rendering and tokenizing


def _cfg(**kw) -> PreferenceDataConfig:
    return PreferenceDataConfig(max_len=kw.pop("max_len", 64), **kw)


def _ids(tok, text: str, special: bool = True) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


def test_full_text_pairs_without_prompt_key(tok):
    raw = datasets.Dataset.from_list(
        [{"chosen": "Human: hi\nAssistant: good", "rejected": "Human: hi\nAssistant: bad"}]
    )
    pairs, dropped = tokenize_pairs(raw, tok, _cfg())
    assert dropped == 0
    assert pairs[0]["chosen_ids"] == _ids(tok, "Human: hi\nAssistant: good") + [tok.eos_token_id]
    assert pairs[0]["rejected_ids"] == _ids(tok, "Human: hi\nAssistant: bad") + [tok.eos_token_id]


def test_prompt_key_input_template_and_margin(tok):
    raw = datasets.Dataset.from_list([{"q": "hi", "c": "good", "r": "bad", "m": 2}])
    cfg = _cfg(
        prompt_key="q",
        chosen_key="c",
        rejected_key="r",
        margin_key="m",
        input_template="Human: {}\nAssistant: ",
    )
    pairs, _ = tokenize_pairs(raw, tok, cfg)
    assert pairs[0]["chosen_ids"][:-1] == _ids(tok, "Human: hi\nAssistant: good")
    assert pairs[0]["margin"] == 2.0


def test_chat_template_rendering(tok):
    user = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    reply = [{"role": "assistant", "content": "good"}]
    full = tok.apply_chat_template(user + reply, tokenize=False)
    cfg = _cfg(prompt_key="p", apply_chat_template=True)
    cases = [
        ({"p": user, "chosen": "good", "rejected": "bad"}, prompt + "good"),
        ({"p": "hi", "chosen": "good", "rejected": "bad"}, prompt + "good"),  # str -> user turn
        ({"p": user, "chosen": reply, "rejected": [{"role": "assistant", "content": "bad"}]}, full),
    ]
    for row, text in cases:
        pairs, _ = tokenize_pairs(datasets.Dataset.from_list([row]), tok, cfg)
        assert pairs[0]["chosen_ids"] == _ids(tok, text, special=False) + [tok.eos_token_id], row
    whole = {"chosen": user + reply, "rejected": user + [{"role": "assistant", "content": "bad"}]}
    pairs, _ = tokenize_pairs(
        datasets.Dataset.from_list([whole]), tok, _cfg(apply_chat_template=True)
    )
    assert pairs[0]["chosen_ids"][:-1] == _ids(tok, full, special=False)
    with pytest.raises(
        UserError,
        match="--chosen_key 'chosen': values are chat-message lists; add --apply_chat_template",
    ):
        tokenize_pairs(datasets.Dataset.from_list([whole]), tok, _cfg())


def test_truncation_keeps_eos_and_drops_identical_pairs(tok, caplog):
    long_prompt = " ".join(["the cat sees the dog"] * 20)
    raw = datasets.Dataset.from_list(
        [
            {"chosen": long_prompt + " good", "rejected": long_prompt + " bad"},  # same after cut
            {"chosen": "good", "rejected": "bad"},
            {"chosen": "same", "rejected": "same"},
        ]
    )
    with caplog.at_level("WARNING"):
        pairs, dropped = tokenize_pairs(raw, tok, _cfg(max_len=16))
    assert dropped == 2 and len(pairs) == 1
    assert "dropped 2 of 3 pairs" in caplog.text
    long_cut = finish_ids(_ids(tok, long_prompt), pad_id=0, eos_id=1, max_len=16)
    assert len(long_cut) == 16 and long_cut[-1] == 1


def test_pad_equal_to_eos_appends_nothing_and_strips_trailing_pads():
    assert finish_ids([5, 6], pad_id=1, eos_id=1, max_len=8) == [5, 6]
    assert finish_ids([5, 6, 1, 1], pad_id=1, eos_id=1, max_len=8) == [5, 6]
    assert finish_ids([5, 6, 1], pad_id=0, eos_id=1, max_len=8) == [5, 6, 1]  # no second EOS
    assert finish_ids([5, 6, 7, 8], pad_id=0, eos_id=1, max_len=3) == [5, 6, 1]


# ---------------------------------------------------------------- batching


def test_collate_concatenates_chosen_then_rejected_right_padded():
    rows = {
        "chosen_ids": [[5, 6, 1], [7, 1]],
        "rejected_ids": [[8, 1], [9, 9, 9, 1]],
        "margin": [0.5, 1.0],
    }
    b = collate_pairs(rows, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 1, 0], [7, 1, 0, 0], [8, 1, 0, 0], [9, 9, 9, 1]]
    assert b.attention_mask.sum(1).tolist() == [3, 2, 2, 4]
    assert b.margin.tolist() == [0.5, 1.0] and b.num_pairs == b.num_valid == 2


def test_schedule_shards_by_rank_and_resumes_exactly():
    def sched(rank: int, seed: int = 3) -> StepSchedule:
        return StepSchedule(num_items=50, global_batch=8, world_size=2, rank=rank, seed=seed)

    s0, s1 = sched(0), sched(1)
    assert s0.steps_per_epoch == 6
    epoch0 = []
    for pos in s0.positions(DataPosition(), max_epochs=2):
        a, b = s0.rank_indices(pos.epoch, pos.step), s1.rank_indices(pos.epoch, pos.step)
        assert len(a) == len(b) == 4 and not set(a) & set(b)
        if pos.epoch == 0:
            epoch0 += a + b
    assert len(set(epoch0)) == 48  # no item twice within an epoch
    assert s0.rank_indices(1, 0) != s0.rank_indices(0, 0)  # reshuffled per epoch
    assert sched(0).rank_indices(1, 2) == s0.rank_indices(1, 2)  # deterministic
    assert sched(0, seed=4).rank_indices(0, 0) != s0.rank_indices(0, 0)
    full = list(s0.positions(DataPosition(), 2))
    assert list(s0.positions(DataPosition(1, 2), 2)) == full[8:]
    assert DataPosition.from_global_step(6, 6) == DataPosition(1, 0)  # epoch boundary


def test_loader_micro_batches_and_eval_shards():
    pairs = datasets.Dataset.from_list(
        [{"chosen_ids": [i + 2, 1], "rejected_ids": [i + 3, 1]} for i in range(20)]
    )
    loader = PreferenceLoader(pairs, StepSchedule(20, 8, 2, 1, seed=0), micro_batch=2, pad_id=0)
    batches = loader.step_batches(DataPosition(0, 1))
    assert [b.input_ids.shape for b in batches] == [(4, 2), (4, 2)]
    firsts = [row[0] - 2 for b in batches for row in b.input_ids[:2].tolist()]
    assert firsts == loader.schedule.rank_indices(0, 1)
    shards = [eval_shard(7, 2, r, micro_batch=3) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 2  # same number of forwards on every rank
    seen = [i for shard in shards for idx, valid in shard for i in idx[:valid]]
    assert sorted(seen) == list(range(7))


def test_hold_out_is_disjoint_and_seeded():
    pairs = datasets.Dataset.from_list(
        [{"chosen_ids": [i], "rejected_ids": [0]} for i in range(300)]
    )
    train, held = hold_out(pairs, seed=1)
    assert len(held) == 8 and len(train) == 292  # max(1%, 8)
    assert not {r[0] for r in held["chosen_ids"]} & {r[0] for r in train["chosen_ids"]}
    assert hold_out(pairs, seed=1)[1]["chosen_ids"] == held["chosen_ids"]
    assert len(hold_out(pairs.select(range(10)), seed=1)[1]) == 5  # at most half
