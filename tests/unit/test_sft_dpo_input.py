"""`sft` and `dpo` before any model or process group: what each sample learns (plain text,
chat, multi-turn, pretrain mode, truncation), and bad input as one line naming the file and
row, exit 2, nothing written. Also the config factory defaults both commands rely on."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from fsdp_rlhf.cli import app
from fsdp_rlhf.config import SFTDataConfig
from fsdp_rlhf.data.sft import collate_samples, tokenize_samples
from tests.rm_utils import synthetic_pairs, write_jsonl


@pytest.fixture(scope="module")
def tok(tiny_qwen2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2)


def _learned(tok, rows, **cfg):
    import datasets

    samples, dropped = tokenize_samples(datasets.Dataset.from_list(rows), tok, SFTDataConfig(**cfg))
    out = []
    for ids, mask in zip(samples["input_ids"], samples["loss_mask"], strict=True):
        out.append(tok.decode([t for t, m in zip(ids, mask, strict=True) if m]))
    return out, dropped


def test_plain_prompt_response_learns_response_and_eos(tok):
    rows = [{"input": "cat dog", "output": "red"}]
    learned, _ = _learned(tok, rows, output_key="output")
    assert learned == [" red<|endoftext|>"]


def test_chat_learns_assistant_turns(tok):
    conv = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "one two"},
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": "three"},
    ]
    rows = [{"input": conv}]
    last, _ = _learned(tok, rows, apply_chat_template=True)
    assert last == ["three<|im_end|>\n"]
    every, _ = _learned(tok, rows, apply_chat_template=True, multiturn=True)
    assert every == ["one two<|im_end|>\nthree<|im_end|>\n"]
    pair = [{"input": "hello", "output": "one two"}]
    single, _ = _learned(tok, pair, apply_chat_template=True, output_key="output")
    assert single == ["one two<|im_end|>\n"]


def test_pretrain_mode_learns_every_token_but_the_first(tok):
    learned, _ = _learned(tok, [{"input": "the cat sees the moon"}], pretrain_mode=True)
    assert learned == [" cat sees the moon<|endoftext|>"]


def test_truncated_away_responses_are_dropped_and_counted(tok):
    rows = [{"input": "a " * 40, "output": "red"}, {"input": "cat", "output": "blue"}]
    learned, dropped = _learned(tok, rows, output_key="output", max_len=16)
    assert dropped == 1 and learned == [" blue<|endoftext|>"]


def test_collate_right_pads():
    batch = collate_samples({"input_ids": [[5, 6, 7], [8]], "loss_mask": [[0, 1, 1], [1]]}, 0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.loss_mask.tolist() == [[False, True, True], [True, False, False]]


@pytest.fixture
def bad(tiny_qwen2, tmp_path):
    sft_rows = [{"input": "cat", "output": "red"}] * 8
    write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    write_jsonl(tmp_path / "sft_empty.jsonl", [*sft_rows[:3], {"input": "dog", "output": " "}])
    write_jsonl(tmp_path / "sft_nokey.jsonl", [{"prompt": "cat", "output": "red"}])
    pairs = synthetic_pairs(8, seed=0)
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    same = [*pairs[:4], {"chosen": "Human: x", "rejected": "Human: x"}]
    write_jsonl(tmp_path / "same.jsonl", same)
    write_jsonl(tmp_path / "empty.jsonl", [{"chosen": "", "rejected": "b"}])
    sft = [
        "sft",
        "--pretrain",
        tiny_qwen2,
        "--save_path",
        str(tmp_path / "model"),
        "--output_key",
        "output",
        "--train_batch_size",
        "2",
        "--micro_train_batch_size",
        "1",
    ]
    dpo = [
        "dpo",
        "--pretrain",
        tiny_qwen2,
        "--save_path",
        str(tmp_path / "model"),
        "--train_batch_size",
        "2",
        "--micro_train_batch_size",
        "1",
    ]
    return {
        "empty response": (sft + ["--dataset", str(tmp_path / "sft_empty.jsonl")],
                           r"sft_empty\.jsonl: row 4: --output_key 'output': empty response"),
        "missing key": (sft + ["--dataset", str(tmp_path / "sft_nokey.jsonl")],
                        r"--input_key 'input': no such key in --dataset .*sft_nokey\.jsonl"),
        "no response key": (sft[:-6] + ["--dataset", str(tmp_path / "sft.jsonl")],
                            r"sft\.jsonl: row 1: .* needs --output_key"),
        "identical pair": (dpo + ["--dataset", str(tmp_path / "same.jsonl")],
                           r"same\.jsonl: row 5: 'chosen' and 'rejected' are identical"),
        "empty side": (dpo + ["--dataset", str(tmp_path / "empty.jsonl")],
                       r"empty\.jsonl: row 1: 'chosen' is empty"),
        "ipo + smoothing": (dpo + ["--dataset", str(tmp_path / "pairs.jsonl"), "--ipo",
                                   "--label_smoothing", "0.1"], r"--label_smoothing with --ipo"),
        "margin key": (dpo + ["--dataset", str(tmp_path / "pairs.jsonl"), "--margin_key", "m"],
                       r"--margin_key is train-rm's"),
        "missing ref": (dpo + ["--dataset", str(tmp_path / "pairs.jsonl"), "--ref_pretrain",
                               str(tmp_path / "nope")], r"--ref_pretrain .*nope: does not exist"),
    }  # fmt: skip


def test_bad_input_is_one_line_and_writes_nothing(bad, tmp_path):
    runner = CliRunner()
    for name, (argv, pattern) in bad.items():
        result = runner.invoke(app, argv)
        assert result.exit_code == 2, (name, result.output, result.exception)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, result.stderr)
        assert re.search(pattern, lines[0]), (name, lines[0])
        assert not (tmp_path / "model").exists(), name


def test_section_factory_defaults_survive_a_flag():
    from fsdp_rlhf.config import DPOConfig, PPOConfig, SFTConfig
    from fsdp_rlhf.config_base import build_config

    dpo, _ = build_config(DPOConfig, ["--train_batch_size", "16"])
    assert dpo.batch.packing_samples and dpo.batch.train_batch_size == 16
    sft, _ = build_config(SFTConfig, ["--max_norm", "0.5"])
    assert sft.optim.lr == 5e-6 and sft.optim.max_norm == 0.5
    ppo, _ = build_config(PPOConfig, ["--max_norm", "0.5"])
    assert (ppo.actor_optim.lr, ppo.critic_optim.lr) == (1e-6, 9e-6)


def test_tokenizer_chat_template_replaces_the_tokenizers(tiny_qwen2, tmp_path):
    from fsdp_rlhf.config import SFTConfig, plan_offline_batches
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.trainers.offline.data import prepare_sft_data

    conv = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "one two"}]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": conv}] * 4)
    template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    argv = ["--pretrain", tiny_qwen2, "--dataset", str(tmp_path / "chat.jsonl"),
            "--input_key", "messages", "--apply_chat_template", "--tokenizer_chat_template",
            template, "--save_path", str(tmp_path / "out"), "--train_batch_size", "2",
            "--micro_train_batch_size", "1"]  # fmt: skip
    cfg, _ = build_config(SFTConfig, argv)
    from fsdp_rlhf.rules import check_command

    data = prepare_sft_data(cfg, plan_offline_batches(cfg.batch, 1), check_command("sft", cfg))
    ids, mask = data.train[0]["input_ids"], data.train[0]["loss_mask"]
    assert data.tokenizer.decode(ids) == "[user]hello[assistant]one two"
    assert data.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "one two"


def test_help_shows_a_sections_own_defaults():
    from fsdp_rlhf.config import DPOConfig, PPOConfig, SFTConfig
    from fsdp_rlhf.config_base import flags_help

    def default(cls, flag):
        return next(row[3] for row in flags_help(cls) if row[1] == flag)

    assert default(DPOConfig, "--packing_samples") == "True"
    assert default(SFTConfig, "--learning_rate") == "5e-06"
    assert default(PPOConfig, "--actor_learning_rate") == "1e-06"


@pytest.mark.parametrize("eos", ["<|endoftext|>", "<|im_end|>"])
def test_dpo_and_sft_end_chat_rows_with_the_templates_end_of_turn(tiny_qwen2, tmp_path, eos):
    """One rule for both commands (and TRL's): with --apply_chat_template the template's
    end of turn ends the sequence and no EOS follows; plain text ends with EOS. With an
    instruct tokenizer (EOS <|im_end|>) dpo used to end each side `<|im_end|>\\n<|im_end|>`,
    one token more than sft on the same rows. Message-list rows and string rows."""
    from transformers import AutoTokenizer

    from fsdp_rlhf.config import DPOConfig, SFTConfig, plan_offline_batches
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.rules import check_command
    from fsdp_rlhf.trainers.offline.data import prepare_dpo_data, prepare_sft_data

    model = tmp_path / "model"
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    tok.eos_token = eos
    tok.save_pretrained(model)
    for f in ("config.json", "model.safetensors"):
        (model / f).symlink_to(f"{tiny_qwen2}/{f}")
    user = [{"role": "user", "content": "cat dog"}]
    good, bad = (
        [{"role": "assistant", "content": "red"}],
        [{"role": "assistant", "content": "blue"}],
    )
    chat = {"p": user, "c": good, "r": bad}
    strings = {"p": "cat dog", "c": "red", "r": "blue"}
    write_jsonl(tmp_path / "pairs.jsonl", [chat, strings] * 4)
    sft_rows = [{"i": user, "o": good}, {"i": "cat dog", "o": "red"}] * 4
    write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    common = ["--pretrain", str(model), "--apply_chat_template", "--train_batch_size", "8",
              "--micro_train_batch_size", "1", "--save_path", str(tmp_path / "out")]  # fmt: skip
    keys = ["--prompt_key", "p", "--chosen_key", "c", "--rejected_key", "r"]
    dpo, _ = build_config(DPOConfig, [*common, "--dataset", str(tmp_path / "pairs.jsonl"), *keys])
    sft, _ = build_config(SFTConfig, [*common, "--dataset", str(tmp_path / "sft.jsonl"),
                          "--input_key", "i", "--output_key", "o"])  # fmt: skip

    def prepared(prepare_data, command, cfg):
        return prepare_data(cfg, plan_offline_batches(cfg.batch, 1), check_command(command, cfg))

    pairs = prepared(prepare_dpo_data, "dpo", dpo).train
    samples = prepared(prepare_sft_data, "sft", sft).train
    full = tok.apply_chat_template(user + good, tokenize=False)
    assert full.endswith("red<|im_end|>\n")
    expected = tok(full, add_special_tokens=False)["input_ids"]
    for row in range(2):  # a message-list row and a string row
        assert list(pairs[row]["chosen_ids"]) == expected, tok.decode(pairs[row]["chosen_ids"])
        assert list(samples[row]["input_ids"]) == expected
    # plain text (no template) still ends with EOS, in both commands
    plain = [a for a in common if a != "--apply_chat_template"]
    write_jsonl(tmp_path / "plain.jsonl", [strings] * 8)
    dpo, _ = build_config(DPOConfig, [*plain, "--dataset", str(tmp_path / "plain.jsonl"), *keys])
    ids = prepared(prepare_dpo_data, "dpo", dpo).train[0]["chosen_ids"]
    assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == "cat dogred"
