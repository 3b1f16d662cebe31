"""Config tree: precedence, strictness, AIAK-RLHF's flags, derived sizes."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from fsdp_rlhf.config import PPOConfig, RMConfig, plan_offline_batches, plan_ppo_batches
from fsdp_rlhf.config_base import ConfigError, build_config, dump_yaml, from_dict, iter_leaves

# Flags of AIAK-RLHF's RM and PPO scripts (its guide's sections 1.3/1.4 and 2.3/2.4), verbatim.
AIAK_RM_FLAGS = """--pretrain --save_path --save_steps --logging_steps --eval_steps
--train_batch_size --micro_train_batch_size --bf16 --max_epochs --max_len --zero_stage
--learning_rate --dataset
--dataset_probs --prompt_key --chosen_key --rejected_key --apply_chat_template --flash_attn
--gradient_checkpointing --tensorboard --eval_dataset --seed --lr_warmup_ratio --lr_scheduler
--max_norm --margin_key --loss --center_rewards_coefficient --value_head_prefix --ckpt_path
--load_checkpoint --input_template --max_samples""".split()
AIAK_PPO_FLAGS = """--pretrain --reward_pretrain --micro_train_batch_size --micro_rollout_batch_size
--rollout_batch_size --colocate_all --bf16 --max_samples --max_epochs --generate_max_len
--prompt_max_len --zero_stage --actor_learning_rate --critic_learning_rate --init_kl_coef
--normalize_reward --save_path --prompt_data --prompt_data_probs --input_key --input_template
--apply_chat_template --vllm_num_engines --vllm_tensor_parallel_size
--vllm_gpu_memory_utilization --ref_reward_offload --adam_offload --flash_attn
--gradient_checkpointing --save_steps --logging_steps --tensorboard --num_nodes
--num_gpus_per_node --critic_pretrain --n_samples_per_prompt --advantage_estimator --gamma
--lambd --eps_clip --value_clip --dual_clip --kl_estimator --use_kl_loss --kl_target
--entropy_loss_coef --max_norm --freezing_actor_steps --ppo_epochs --temperature --top_p --seed
--ckpt_path --load_checkpoint --label_key --remote_rm_url""".split()


def _value_for(cls, flag: str) -> list[str]:
    from fsdp_rlhf.config_base import _flag_names

    leaf = _flag_names(cls)[flag[2:]][0]
    samples = {bool: [], int: ["2"], float: ["0.5"], str: ["x"]}
    tp = leaf.type
    if tp in samples:
        return samples[tp]
    text = str(tp)
    if "Literal" in text:
        return [re.findall(r"'([^']+)'", text)[-1]]
    if "tuple" in text:
        return ["0.9", "0.95"]
    if "int" in text:
        return ["2"]
    return ["0.5"] if "float" in text else ["x"]


@pytest.mark.parametrize("cls,flags", [(RMConfig, AIAK_RM_FLAGS), (PPOConfig, AIAK_PPO_FLAGS)])
def test_every_aiak_flag_is_accepted_with_underscores_and_dashes(cls, flags):
    for flag in flags:
        argv = [flag, *_value_for(cls, flag)]
        if flag == "--dual_clip":
            argv = [flag, "3.0"]
        if flag == "--lambd":
            argv = [flag, "0.9"]
        if flag in ("--gamma",):
            argv = [flag, "0.99"]
        if flag == "--eps_clip":
            argv = [flag, "0.1"]
        if flag == "--flash_attn":  # flash-attn has no fp32 kernels; AIAK's scripts pass both
            argv = [flag, "--bf16"]
        build_config(cls, argv)
        build_config(cls, [flag.replace("_", "-"), *argv[1:]])


def test_defaults_match_aiak_tables():
    rm, _ = build_config(RMConfig, [])
    assert (rm.batch.train_batch_size, rm.batch.micro_train_batch_size) == (128, 8)
    assert (rm.data.max_len, rm.fsdp.zero_stage, rm.optim.lr) == (512, 2, 1e-5)
    assert (rm.ckpt.save_steps, rm.logging.eval_steps, rm.ckpt.save_path) == (-1, -1, "./ckpt")
    ppo, _ = build_config(PPOConfig, [])
    assert ppo.batch.rollout_batch_size == 512 and ppo.rollout.micro_rollout_batch_size == 8
    assert (ppo.actor_optim.lr, ppo.critic_optim.lr, ppo.algo.init_kl_coef) == (1e-6, 9e-6, 0.02)
    assert ppo.rollout.vllm_gpu_memory_utilization == 0.9 and ppo.placement.colocate_all
    assert (ppo.rollout.generate_max_len, ppo.data.prompt_max_len) == (1024, 1024)


def test_precedence_defaults_yaml_flags(tmp_path):
    cfg_file = tmp_path / "x.yaml"
    cfg_file.write_text("batch:\n  train_batch_size: 64\n  micro_train_batch_size: 4\nseed: 7\n")
    cfg, _ = build_config(RMConfig, ["--config", str(cfg_file), "--train_batch_size", "32"])
    assert cfg.batch.train_batch_size == 32  # flag beats YAML
    assert cfg.batch.micro_train_batch_size == 4  # YAML beats default
    assert cfg.batch.max_epochs == 1  # default
    assert cfg.seed == 7


def test_unknown_key_and_wrong_type_name_the_dotted_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch:\n  train_batch_sise: 64\n")
    with pytest.raises(ConfigError, match=r"batch\.train_batch_sise.*train_batch_size"):
        build_config(RMConfig, ["--config", str(bad)])
    bad.write_text("optim:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"optim\.lr: expected a float"):
        build_config(RMConfig, ["--config", str(bad)])
    with pytest.raises(ConfigError, match="unknown flag --train_batch"):
        build_config(RMConfig, ["--train_batch", "3"])
    with pytest.raises(ConfigError, match="expected an int"):
        build_config(RMConfig, ["--train_batch_size", "many"])
    with pytest.raises(ConfigError, match="one of"):
        build_config(RMConfig, ["--loss", "hinge"])


def test_local_rank_from_torch_distributed_launch_is_ignored():
    a, _ = build_config(RMConfig, ["--local-rank=3", "--bf16"])
    b, _ = build_config(RMConfig, ["--local_rank", "1", "--bf16"])
    assert a == b and a.backend.bf16


def test_booleans_switch_and_negate_and_aliases_fan_out():
    cfg, debug = build_config(PPOConfig, ["--bf16", "--no_colocate_all", "--max_norm", "0.5"])
    assert cfg.backend.bf16 and not cfg.placement.colocate_all and not debug
    assert cfg.actor_optim.max_norm == cfg.critic_optim.max_norm == 0.5
    cfg, debug = build_config(PPOConfig, ["--bf16=false", "--debug", "--lambd", "0.9"])
    assert not cfg.backend.bf16 and debug and cfg.algo.lam == 0.9


def test_configs_are_frozen_and_round_trip_through_yaml():
    import yaml

    cfg, _ = build_config(PPOConfig, ["--pretrain", "m", "--adam_betas", "0.8", "0.9"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]
    again = from_dict(PPOConfig, yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg


def test_every_leaf_has_help_text():
    for cls in (RMConfig, PPOConfig):
        missing = [leaf.path for leaf in iter_leaves(cls) if not leaf.help.strip()]
        assert not missing, missing


def test_validation_errors():
    with pytest.raises(ConfigError, match="lambd"):
        build_config(PPOConfig, ["--lambd", "1.5"])
    with pytest.raises(ConfigError, match="zero_stage"):
        build_config(RMConfig, ["--zero_stage", "4"])
    with pytest.raises(ConfigError, match="dual_clip"):
        build_config(PPOConfig, ["--dual_clip", "0.5"])


def test_plan_offline_batches():
    cfg, _ = build_config(RMConfig, ["--train_batch_size", "128", "--micro_train_batch_size", "4"])
    plan = plan_offline_batches(cfg.batch, world_size=8)
    assert (plan.grad_accum_steps, plan.batch_size_per_rank) == (4, 16)
    with pytest.raises(ConfigError, match="divisible"):
        plan_offline_batches(cfg.batch, world_size=3)


def test_plan_ppo_batches():
    argv = "--rollout_batch_size 16 --n_samples_per_prompt 4 --train_batch_size 32 "
    argv += "--micro_train_batch_size 2 --micro_rollout_batch_size 8 --vllm_tensor_parallel_size 2"
    cfg, _ = build_config(PPOConfig, argv.split())
    plan = plan_ppo_batches(cfg, world_size=4)
    assert (plan.num_engines, plan.tp_size, plan.train_batch_size_per_rank) == (2, 2, 8)
    assert (plan.micro_rollout_batch_size, plan.optimizer_steps_per_epoch) == (8, 2)
    with pytest.raises(ConfigError, match="vllm_num_engines"):
        plan_ppo_batches(
            build_config(PPOConfig, [*argv.split(), "--vllm_num_engines", "4"])[0], world_size=4
        )
    with pytest.raises(ConfigError, match="rollout_batch_size"):
        plan_ppo_batches(cfg, world_size=6)
    grpo, _ = build_config(PPOConfig, ["--advantage_estimator", "grpo"])
    with pytest.raises(ConfigError, match="n_samples_per_prompt"):
        plan_ppo_batches(grpo, world_size=1)


def test_cli_help_lists_commands_and_flags():
    exe = [sys.executable, "-m", "fsdp_rlhf.cli"]
    out = subprocess.run([*exe, "--help"], capture_output=True, text=True, check=True).stdout
    assert "train-rm" in out and "ppo" in out and "doctor" in out


@pytest.mark.parametrize("command,cls", [("ppo", PPOConfig), ("train-rm", RMConfig)])
def test_piped_help_has_every_flag_on_one_line(command, cls):
    """Narrow terminal, piped: every flag's name, type, default and help on its own line,
    grouped by section, so `--help | grep -- --flag` finds it."""
    from fsdp_rlhf.config_base import flags_help

    env = {"COLUMNS": "40", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_rlhf.cli", command, "--help"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    lines = out.splitlines()
    for _, flag, _, default, text in flags_help(cls):
        hits = [line for line in lines if line.strip().startswith(f"{flag} ")]
        assert len(hits) == 1, flag
        assert f"[default: {default}]" in hits[0] and text.split(".")[0] in hits[0], hits[0]
    for section in (
        "Models:",
        "Data:",
        "Algorithm:",
        "Batch sizes:",
        "Optimizer:",
        "Checkpoints:",
        "Logging:",
        "LoRA:",
    ):
        assert section in lines or command == "train-rm", section
    assert any(line.startswith("OpenRLHF aliases") for line in lines)
    assert any(line.strip().startswith("--ds.zero_stage") for line in lines)


def test_cli_bad_flag_is_one_line_and_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_rlhf.cli", "train-rm", "--no_such_flag", "1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown flag --no_such_flag")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- algorithm flags (issue #16)


def _algo(*argv: str):
    return build_config(PPOConfig, list(argv))[0].algo


def test_eps_clip_low_high_sets_both_sides_and_gspo_clip():
    algo = _algo()
    assert (algo.eps_clip, algo.eps_clip_high, algo.eps_clip_low_high) == (0.2, None, ())
    assert algo.policy_loss_type == "ppo" and algo.gspo_eps_clip_low_high == (3e-4, 4e-4)
    algo = _algo("--eps_clip_low_high", "0.2", "0.28")
    assert (algo.eps_clip, algo.eps_clip_high) == (0.2, 0.28)
    algo = _algo("--eps-clip-low-high", "0.1", "0.3", "--eps_clip", "0.5")
    assert (algo.eps_clip, algo.eps_clip_high) == (0.1, 0.3)  # the pair wins
    # OpenRLHF GSPO scripts pass their small clip through --eps_clip_low_high.
    algo = _algo("--policy_loss_type", "gspo", "--eps_clip_low_high", "3e-4", "5e-4")
    assert algo.policy_loss_type == "gspo" and algo.gspo_eps_clip_low_high == (3e-4, 5e-4)
    algo = _algo("--gspo_eps_clip_low_high", "1e-3", "2e-3", "--eps_clip_low_high", "0.2", "0.3")
    assert algo.gspo_eps_clip_low_high == (1e-3, 2e-3)
    for bad in (["--eps_clip_low_high", "0.2"], ["--gspo_eps_clip_low_high", "1", "2", "3"]):
        with pytest.raises(ConfigError, match="2 values"):
            _algo(*bad)
    with pytest.raises(ConfigError, match="one of"):
        _algo("--policy_loss_type", "grpo")


def test_advantage_estimators_and_loss_agg_modes():
    for est in ("reinforce_plus_plus_baseline", "reinforce_baseline"):
        cfg, _ = build_config(PPOConfig, ["--advantage_estimator", est])
        with pytest.raises(ConfigError, match="n_samples_per_prompt"):
            plan_ppo_batches(cfg, world_size=1)
    for mode in (
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ):
        assert _algo("--loss_agg_mode", mode).loss_agg_mode == mode
    with pytest.raises(ConfigError, match="one of"):
        _algo("--loss_agg_mode", "sum")


def test_is_correction_flags():
    algo = _algo()
    assert (algo.is_correction, algo.is_truncated_threshold) == ("none", (0.5, 5.0))
    assert not algo.use_rollout_logprobs_as_old
    algo = _algo("--is_correction", "icepop", "--is_truncated_threshold", "0.8", "1.25")
    assert (algo.is_correction, algo.is_truncated_threshold) == ("icepop", (0.8, 1.25))
    assert _algo("--is_correction", "seq-mask-tis").is_correction == "seq_mask_tis"
    # OpenRLHF's spellings and --use_tis: tests/unit/test_compat.py
    for bad in (["1.0", "1.0"], ["2", "1"], ["-1", "2"], ["1"]):
        with pytest.raises(ConfigError, match="is_truncated_threshold"):
            _algo("--is_correction", "tis", "--is_truncated_threshold", *bad)
    assert _algo("--use_rollout_logprobs_as_old").use_rollout_logprobs_as_old
    with pytest.raises(ConfigError, match="use_rollout_logprobs_as_old"):
        _algo("--use_rollout_logprobs_as_old", "--is_correction", "tis")


def test_dynamic_filtering_and_overlong_flags():
    algo = _algo()
    assert not algo.dynamic_filtering and algo.dynamic_filtering_reward_range == ()
    assert algo.max_num_gen_batches == 0 and algo.overlong_buffer_len is None
    assert algo.overlong_penalty_factor == 1.0
    argv = ["--dynamic_filtering", "--dynamic_filtering_reward_range", "0", "1"]
    argv += ["--max_num_gen_batches", "5", "--overlong_buffer_len", "256"]
    argv += ["--overlong_penalty_factor", "0.5", "--generate_max_len", "1024"]
    algo = _algo(*argv)
    assert algo.dynamic_filtering and algo.dynamic_filtering_reward_range == (0.0, 1.0)
    assert (algo.max_num_gen_batches, algo.overlong_buffer_len) == (5, 256)
    assert algo.overlong_penalty_factor == 0.5
    cfg, _ = build_config(PPOConfig, ["--dynamic_filtering"])
    with pytest.raises(ConfigError, match="dynamic_filtering"):
        plan_ppo_batches(cfg, world_size=1)
    with pytest.raises(ConfigError, match="dynamic_filtering_reward_range"):
        _algo("--dynamic_filtering_reward_range", "1", "0")
    with pytest.raises(ConfigError, match="max_num_gen_batches"):
        _algo("--max_num_gen_batches", "-1")
    with pytest.raises(ConfigError, match="overlong_buffer_len"):
        _algo("--overlong_buffer_len", "0")
    with pytest.raises(ConfigError, match="generate_max_len"):
        _algo("--overlong_buffer_len", "2048", "--generate_max_len", "1024")
    with pytest.raises(ConfigError, match="overlong_penalty_factor"):
        _algo("--overlong_penalty_factor", "-1")


def test_eval_flags():
    cfg, _ = build_config(PPOConfig, [])
    assert cfg.eval.eval_dataset is None and cfg.eval.eval_n_samples_per_prompt == 4
    assert cfg.eval.save_best_metric is None and cfg.logging.eval_steps == -1
    argv = ["--eval_dataset", "e.jsonl", "--eval_steps", "10", "--eval_n_samples_per_prompt", "8"]
    cfg, _ = build_config(PPOConfig, [*argv, "--save_best_metric", "pass@8"])
    assert (cfg.eval.eval_dataset, cfg.logging.eval_steps) == ("e.jsonl", 10)
    assert (cfg.eval.eval_n_samples_per_prompt, cfg.eval.save_best_metric) == (8, "pass@8")
    assert build_config(PPOConfig, [*argv, "--save_best_metric", "eval/pass@1"])[0]
    for bad in ("pass@9", "pass@0", "reward", "pass@k"):
        with pytest.raises(ConfigError, match="save_best_metric"):
            build_config(PPOConfig, [*argv, "--save_best_metric", bad])
    with pytest.raises(ConfigError, match="eval_dataset"):
        build_config(PPOConfig, ["--save_best_metric", "pass@1"])
    with pytest.raises(ConfigError, match="eval_n_samples_per_prompt"):
        build_config(PPOConfig, ["--eval_n_samples_per_prompt", "0"])
    assert cfg.eval.eval_temperature == 0.6
    assert build_config(PPOConfig, ["--eval_temperature", "0"])[0].eval.eval_temperature == 0.0
    with pytest.raises(ConfigError, match="eval_temperature"):
        build_config(PPOConfig, ["--eval_temperature", "-1"])


def test_new_algo_flags_round_trip_through_yaml_and_show_in_help():
    import yaml

    argv = ["--is_correction", "tis", "--eps_clip_low_high", "0.2", "0.28"]
    argv += ["--policy_loss_type", "gspo"]
    argv += ["--eval_dataset", "e", "--save_best_metric", "pass@2"]
    cfg, _ = build_config(PPOConfig, argv)
    assert from_dict(PPOConfig, yaml.safe_load(dump_yaml(cfg))) == cfg
    from fsdp_rlhf.config_base import flags_help

    names = {row[1] for row in flags_help(PPOConfig)}
    for flag in (
        "--is_correction",
        "--is_truncated_threshold",
        "--use_rollout_logprobs_as_old",
        "--eps_clip_low_high",
        "--policy_loss_type",
        "--dynamic_filtering",
        "--overlong_buffer_len",
        "--eval_n_samples_per_prompt",
        "--eval_temperature",
        "--save_best_metric",
    ):
        assert flag in names, flag


def test_flash_attn_without_bf16_is_one_line_and_exit_2(tmp_path):
    for cls in (RMConfig, PPOConfig):
        with pytest.raises(ConfigError, match="--flash_attn needs --bf16"):
            build_config(cls, ["--flash_attn"])
        cfg, _ = build_config(cls, ["--flash_attn", "--bf16"])
        assert cfg.backend.flash_attn and cfg.backend.bf16
    config = tmp_path / "c.yaml"  # the section's own check, whichever way the values come in
    config.write_text("backend:\n  flash_attn: true\n")
    with pytest.raises(ConfigError, match="needs --bf16"):
        build_config(PPOConfig, ["--config", str(config)])
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_rlhf.cli", "ppo", "--flash_attn", "--pretrain", "/nope"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --flash_attn needs --bf16 (flash-attn has no fp32 kernels)"
    ]


def test_vllm_sleep_level_defaults_to_discarding_weights():
    ppo, _ = build_config(PPOConfig, [])
    assert ppo.rollout.vllm_sleep_level == 2
    ppo, _ = build_config(PPOConfig, ["--vllm_sleep_level", "1"])
    assert ppo.rollout.vllm_sleep_level == 1
    with pytest.raises(ConfigError, match="vllm_sleep_level"):
        build_config(PPOConfig, ["--vllm_sleep_level", "3"])
