"""Config tree: precedence, strictness, AIAK-RLHF's flags, derived sizes."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from typing import ClassVar

import pytest
import yaml

from fsdp_rlhf.config import (
    PPOConfig,
    RMConfig,
    SFTConfig,
    plan_offline_batches,
    plan_ppo_batches,
)
from fsdp_rlhf.config_base import (
    ConfigError,
    build_config,
    command_config,
    doc,
    dump_yaml,
    from_dict,
    iter_leaves,
    section,
)

# Flags of AIAK-RLHF's RM and PPO scripts (its guide's sections 1.3/1.4 and 2.3/2.4), each with a
# value its scripts could pass and the setting(s) it must land in. Values differ from our
# defaults, so a flag that lands in the wrong setting (or nowhere) fails. A switch is given bare.
SHARED = {
    "--save_path": ("/out", {"ckpt.save_path": "/out"}),
    "--save_steps": ("20", {"ckpt.save_steps": 20}),
    "--logging_steps": ("5", {"logging.logging_steps": 5}),
    "--micro_train_batch_size": ("4", {"batch.micro_train_batch_size": 4}),
    "--bf16": (None, {"backend.bf16": True}),
    "--max_epochs": ("3", {"batch.max_epochs": 3}),
    "--zero_stage": ("3", {"fsdp.zero_stage": 3}),
    "--apply_chat_template": (None, {"data.apply_chat_template": True}),
    "--gradient_checkpointing": (None, {"backend.gradient_checkpointing": True}),
    "--tensorboard": ("/tb", {"logging.tensorboard": "/tb"}),
    "--seed": ("7", {"seed": 7}),
    "--ckpt_path": ("/ck", {"ckpt.ckpt_path": "/ck"}),
    "--load_checkpoint": (None, {"ckpt.load_checkpoint": True}),
    "--input_template": ("Q: {} A:", {"data.input_template": "Q: {} A:"}),
    "--max_samples": ("1000", {"data.max_samples": 1000}),
}
AIAK_RM_FLAGS = {
    **SHARED,
    "--pretrain": ("/sft", {"model.pretrain": "/sft"}),
    "--eval_steps": ("50", {"logging.eval_steps": 50}),
    "--train_batch_size": ("64", {"batch.train_batch_size": 64}),
    "--max_len": ("2048", {"data.max_len": 2048}),
    "--learning_rate": ("9e-6", {"optim.lr": 9e-6}),
    "--dataset": ("a.jsonl,b.jsonl", {"data.dataset": "a.jsonl,b.jsonl"}),
    "--dataset_probs": ("0.5,0.5", {"data.dataset_probs": "0.5,0.5"}),
    "--prompt_key": ("prompt", {"data.prompt_key": "prompt"}),
    "--chosen_key": ("good", {"data.chosen_key": "good"}),
    "--rejected_key": ("bad", {"data.rejected_key": "bad"}),
    "--eval_dataset": ("e.jsonl", {"data.eval_dataset": "e.jsonl"}),
    "--lr_warmup_ratio": ("0.1", {"optim.lr_warmup_ratio": 0.1}),
    "--lr_scheduler": ("linear", {"optim.lr_scheduler": "linear"}),
    "--max_norm": ("0.5", {"optim.max_norm": 0.5}),
    "--margin_key": ("margin", {"data.margin_key": "margin"}),
    "--loss": ("logexp", {"loss.loss": "logexp"}),
    "--center_rewards_coefficient": ("0.01", {"loss.center_rewards_coefficient": 0.01}),
    "--value_head_prefix": ("value_head", {"model.value_head_prefix": "value_head"}),
}
AIAK_PPO_FLAGS = {
    **SHARED,
    "--pretrain": ("/sft", {"models.pretrain": "/sft"}),
    "--reward_pretrain": ("/rm", {"models.reward_pretrain": "/rm"}),
    "--micro_rollout_batch_size": ("16", {"rollout.micro_rollout_batch_size": 16}),
    "--rollout_batch_size": ("1024", {"batch.rollout_batch_size": 1024}),
    "--colocate_all": ("false", {"placement.colocate_all": False}),  # on by default
    "--generate_max_len": ("512", {"rollout.generate_max_len": 512}),
    "--prompt_max_len": ("512", {"data.prompt_max_len": 512}),
    "--actor_learning_rate": ("5e-7", {"actor_optim.lr": 5e-7}),
    "--critic_learning_rate": ("5e-6", {"critic_optim.lr": 5e-6}),
    "--init_kl_coef": ("0.01", {"algo.init_kl_coef": 0.01}),
    "--normalize_reward": (None, {"models.normalize_reward": True}),
    "--prompt_data": ("p.jsonl", {"data.prompt_data": "p.jsonl"}),
    "--prompt_data_probs": ("0.3,0.7", {"data.prompt_data_probs": "0.3,0.7"}),
    "--input_key": ("question", {"data.input_key": "question"}),
    "--vllm_num_engines": ("4", {"rollout.vllm_num_engines": 4}),
    "--vllm_tensor_parallel_size": ("2", {"rollout.vllm_tensor_parallel_size": 2}),
    "--vllm_gpu_memory_utilization": ("0.5", {"rollout.vllm_gpu_memory_utilization": 0.5}),
    "--ref_reward_offload": (None, {"placement.ref_reward_offload": True}),
    "--adam_offload": (None, {"fsdp.adam_offload": True}),
    "--num_nodes": ("2", {"placement.num_nodes": 2}),
    "--num_gpus_per_node": ("8", {"placement.num_gpus_per_node": 8}),
    "--critic_pretrain": ("/critic", {"models.critic_pretrain": "/critic"}),
    "--n_samples_per_prompt": ("4", {"batch.n_samples_per_prompt": 4}),
    "--advantage_estimator": ("grpo", {"algo.advantage_estimator": "grpo"}),
    "--gamma": ("0.99", {"algo.gamma": 0.99}),
    "--lambd": ("0.9", {"algo.lam": 0.9}),
    "--eps_clip": ("0.1", {"algo.eps_clip": 0.1}),
    "--value_clip": ("0.3", {"algo.value_clip": 0.3}),
    "--dual_clip": ("3.0", {"algo.dual_clip": 3.0}),
    "--kl_estimator": ("k3", {"algo.kl_estimator": "k3"}),
    "--use_kl_loss": (None, {"algo.use_kl_loss": True}),
    "--kl_target": ("0.1", {"algo.kl_target": 0.1}),
    "--entropy_loss_coef": ("0.001", {"algo.entropy_loss_coef": 0.001}),
    "--max_norm": ("0.5", {"actor_optim.max_norm": 0.5, "critic_optim.max_norm": 0.5}),
    "--freezing_actor_steps": ("5", {"algo.freezing_actor_steps": 5}),
    "--ppo_epochs": ("2", {"algo.ppo_epochs": 2}),
    "--temperature": ("0.7", {"rollout.temperature": 0.7}),
    "--top_p": ("0.9", {"rollout.top_p": 0.9}),
    "--label_key": ("answer", {"data.label_key": "answer"}),
    "--remote_rm_url": ("reward.py", {"models.remote_rm_url": "reward.py"}),
}


def _at(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize(
    "cls,table", [(RMConfig, AIAK_RM_FLAGS), (PPOConfig, AIAK_PPO_FLAGS)], ids=["rm", "ppo"]
)
def test_every_aiak_flag_sets_its_setting_with_underscores_and_dashes(cls, table):
    default, _ = build_config(cls, [])
    for flag, (value, expected) in table.items():
        for spelled in (flag, flag.replace("_", "-")):
            argv = [spelled] if value is None else [spelled, value]
            if flag == "--colocate_all":
                argv = [f"{spelled}={value}"]
            cfg, _ = build_config(cls, argv)
            for path, want in expected.items():
                assert _at(cfg, path) == want, f"{' '.join(argv)} -> {path}"
                assert _at(default, path) != want, f"{flag}: pick a value that is not default"
    # --flash_attn needs --bf16 (no fp32 kernels); AIAK's scripts pass both
    cfg, _ = build_config(cls, ["--flash-attn", "--bf16"])
    assert cfg.backend.flash_attn and cfg.backend.bf16


def test_defaults_match_aiak_tables():
    rm, _ = build_config(RMConfig, [])
    assert (rm.batch.train_batch_size, rm.batch.micro_train_batch_size) == (128, 8)
    assert (rm.data.max_len, rm.fsdp.zero_stage, rm.optim.lr) == (512, 2, 1e-5)
    assert (rm.ckpt.save_steps, rm.logging.eval_steps, rm.ckpt.save_path) == (-1, -1, "./ckpt")
    ppo, _ = build_config(PPOConfig, [])
    assert ppo.batch.rollout_batch_size == 512 and ppo.rollout.micro_rollout_batch_size == 8
    assert (ppo.actor_optim.lr, ppo.critic_optim.lr, ppo.algo.init_kl_coef) == (1e-6, 9e-6, 0.02)
    # unset: the memory plan chooses it before the models load, at most AIAK's 0.9
    assert ppo.rollout.vllm_gpu_memory_utilization is None and ppo.placement.colocate_all
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


def test_the_argv_grammar_refuses_stray_and_extra_values():
    with pytest.raises(ConfigError, match="--bf16 is a switch and takes no value"):
        build_config(RMConfig, ["--bf16", "true"])
    with pytest.raises(ConfigError, match="--train_batch_size needs one value, got 2: 32 64"):
        build_config(RMConfig, ["--train_batch_size", "32", "64"])
    with pytest.raises(ConfigError, match="--max_len needs one value, got none"):
        build_config(RMConfig, ["--max_len"])
    with pytest.raises(ConfigError, match="--config needs a path"):
        build_config(RMConfig, ["--config"])
    with pytest.raises(ConfigError, match="unexpected argument 'ppo'"):
        build_config(PPOConfig, ["ppo", "--bf16"])
    # the translation layer splits a line with the same grammar: nothing foreign, same argv
    from fsdp_rlhf.compat import translate

    argv = ["--adam_betas", "0.8", "0.9", "--bf16=false", "--lambd", "0.9"]
    assert translate("ppo", argv).argv == argv
    cfg, _ = build_config(PPOConfig, argv)
    assert cfg.actor_optim.adam_betas == (0.8, 0.9) and cfg.algo.lam == 0.9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Data:
    seed: int = doc(1, "Shuffle seed.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Init:
    seed: int = doc(2, "Init seed.")


def _two_sections(flat_names: dict | None = None):
    """A command config whose two sections both have a ``seed`` field."""

    @command_config
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Twin:
        FLAT_NAMES: ClassVar[dict] = flat_names or {}
        data: Data = section(Data)
        init: Init = section(Init)

    return Twin


def test_two_sections_sharing_a_flag_name_fail_when_the_class_is_defined():
    from fsdp_rlhf.config_base import ConfigDefinitionError

    with pytest.raises(ConfigDefinitionError, match=r"--seed would name data\.seed, init\.seed"):
        _two_sections()
    # FLAT_NAMES resolves it: one name each, or one name that sets both
    twin = _two_sections({"data_seed": "data.seed", "init_seed": "init.seed"})
    cfg, _ = build_config(twin, ["--data_seed", "5", "--init.seed", "6"])
    assert (cfg.data.seed, cfg.init.seed) == (5, 6)
    with pytest.raises(ConfigError, match="unknown flag --seed"):
        build_config(twin, ["--seed", "5"])
    both = _two_sections({"seed": ("data.seed", "init.seed")})
    assert build_config(both, ["--seed", "9"])[0].init.seed == 9
    with pytest.raises(ConfigDefinitionError, match="no setting data.sed"):
        _two_sections({"seed": ("data.sed", "init.seed")})
    with pytest.raises(ConfigDefinitionError, match="--seed is the flag of init.seed"):
        _two_sections({"seed": "data.seed"})


def test_every_command_config_is_checked_at_import():
    from fsdp_rlhf.commands import COMMANDS
    from fsdp_rlhf.config_base import flag_names

    for command in COMMANDS:
        cls = command.config_class()
        assert cls.__dict__.get("flags_checked"), f"{cls.__name__} lacks @command_config"
        assert "seed" in flag_names(cls), command.name


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
    # grpo with one sample per prompt: a row of the rules table (tests/unit/test_rules.py)


def test_cli_help_lists_every_command_of_the_table():
    from fsdp_rlhf.commands import COMMANDS

    exe = [sys.executable, "-m", "fsdp_rlhf.cli"]
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([*exe, "--help"], capture_output=True, text=True, check=True, env=env)
    listed = re.findall(r"^│ ([a-z][\w-]*) ", out.stdout, flags=re.M)  # the Commands box
    assert listed == [c.name for c in COMMANDS]
    doctor = subprocess.run([*exe, "doctor", "--help"], capture_output=True, text=True, check=True)
    assert doctor.stdout.startswith("fsdp-rlhf doctor flags (same as ppo)")
    assert "--advantage_estimator" in doctor.stdout


@pytest.mark.parametrize(
    "command,cls", [("ppo", PPOConfig), ("train-rm", RMConfig), ("sft", SFTConfig)]
)
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
    for title in (
        "Models:",
        "Data:",
        "Algorithm:",
        "Batch sizes:",
        "Optimizer:",
        "Checkpoints:",
        "Logging:",
        "LoRA:",
    ):
        assert title in lines or command != "ppo", title
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
    from fsdp_rlhf.rules import Refused, check_flags

    for est in ("reinforce_plus_plus_baseline", "reinforce_baseline"):
        cfg, _ = build_config(PPOConfig, ["--advantage_estimator", est])
        with pytest.raises(Refused, match="n_samples_per_prompt 1"):
            check_flags("ppo", cfg)
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
    for bad in (["1.0", "1.0"], ["2", "1"], ["-1", "2"], ["0"], ["1", "2", "3"]):
        with pytest.raises(ConfigError, match="is_truncated_threshold"):
            _algo("--is_correction", "tis", "--is_truncated_threshold", *bad)
    # one value is an upper bound (OpenRLHF 0.11.2's form)
    assert _algo("--is_truncated_threshold", "2").is_truncated_threshold == (0.0, 2.0)
    algo = _algo("--is_correction", "seq_mask", "--is_correction_gating", "tv",
                 "--is_truncated_threshold", "0.1")  # fmt: skip
    assert (algo.is_correction, algo.is_correction_gating) == ("seq_mask", "tv")
    for argv, words in (
        (["--is_correction_gating", "tv"], "add one of them"),
        (["--is_correction", "tis", "--is_correction_gating", "tv"], "clamps the ratio"),
        (["--is_correction", "icepop", "--is_correction_gating", "tv"], "from above only"),
    ):
        with pytest.raises(ConfigError, match=words):
            _algo(*argv)
    assert _algo("--use_rollout_logprobs_as_old").use_rollout_logprobs_as_old
    with pytest.raises(ConfigError, match="use_rollout_logprobs_as_old"):
        _algo("--use_rollout_logprobs_as_old", "--is_correction", "tis")


def test_off_policy_correction_auto_follows_the_placement_and_the_flags():
    """auto resolves to the measured choice of each placement (AUTO_OFF_POLICY), to none when
    --is_correction weighs the trainer's old log-probs (OpenRLHF's meaning), to behaviour in
    bypass mode; explicit values stay; contradictions are one line."""
    from fsdp_rlhf.config.ppo import AUTO_OFF_POLICY

    asynchronous = ["--async_train", "--vllm_num_engines", "1"]
    assert _algo().off_policy_correction == AUTO_OFF_POLICY["colocated"]
    assert _algo(*asynchronous).off_policy_correction == AUTO_OFF_POLICY["async"]
    assert _algo(*asynchronous, "--is_correction", "icepop").off_policy_correction == "none"
    assert _algo("--use_rollout_logprobs_as_old").off_policy_correction == "behaviour"
    for mode in ("none", "behaviour", "decoupled"):
        assert _algo(*asynchronous, "--off_policy_correction", mode).off_policy_correction == mode
        assert _algo("--off_policy_correction", mode).off_policy_correction == mode
    assert _algo("--behaviour_weight_cap", "2").behaviour_weight_cap == 2.0
    for argv, words in (
        (["--off_policy_correction", "behaviour", "--is_correction", "tis"], "use one of them"),
        (["--off_policy_correction", "decoupled", "--is_correction", "icepop"], "use one"),
        (["--off_policy_correction", "none", "--use_rollout_logprobs_as_old"], "use one"),
        (["--behaviour_weight_cap", "1"], "must be > 1"),
        (["--off_policy_correction", "bypass"], "one of"),
    ):
        with pytest.raises(ConfigError, match=words):
            _algo(*argv)


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
    from fsdp_rlhf.rules import Refused, check_flags

    cfg, _ = build_config(
        PPOConfig, ["--dynamic_filtering", "--advantage_estimator", "reinforce++"]
    )
    with pytest.raises(Refused, match="--dynamic_filtering with --n_samples_per_prompt 1"):
        check_flags("ppo", cfg)
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
    from fsdp_rlhf.rules import Refused, check_flags

    with pytest.raises(Refused, match="--save_best_metric without --eval_dataset"):
        check_flags("ppo", build_config(PPOConfig, ["--save_best_metric", "pass@1"])[0])
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
    from fsdp_rlhf.rules import Refused, check_flags

    for cls, command in ((RMConfig, "train-rm"), (PPOConfig, "ppo")):
        with pytest.raises(Refused, match="--flash_attn without --bf16"):
            check_flags(command, build_config(cls, ["--flash_attn"])[0])
        cfg, _ = build_config(cls, ["--flash_attn", "--bf16"])
        assert cfg.backend.flash_attn and cfg.backend.bf16
    config = tmp_path / "c.yaml"  # the rules see the resolved config, whichever way it came
    config.write_text("backend:\n  flash_attn: true\n")
    with pytest.raises(Refused, match="without --bf16"):
        check_flags("ppo", build_config(PPOConfig, ["--config", str(config)])[0])
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_rlhf.cli", "ppo", "--flash_attn", "--pretrain", "/nope"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --flash_attn without --bf16: flash-attn has no fp32 kernels; add --bf16"
    ]


def test_vllm_sleep_level_defaults_to_discarding_weights():
    ppo, _ = build_config(PPOConfig, [])
    assert ppo.rollout.vllm_sleep_level == 2
    ppo, _ = build_config(PPOConfig, ["--vllm_sleep_level", "1"])
    assert ppo.rollout.vllm_sleep_level == 1
    with pytest.raises(ConfigError, match="vllm_sleep_level"):
        build_config(PPOConfig, ["--vllm_sleep_level", "3"])


@pytest.mark.parametrize("cls", [RMConfig, PPOConfig])
def test_guard_flags(cls):
    cfg, _ = build_config(cls, [])
    assert (cfg.guard.max_bad_steps, cfg.guard.dist_timeout_min) == (5, 60)
    cfg, _ = build_config(cls, ["--max_bad_steps", "0", "--dist_timeout_min", "15"])
    assert (cfg.guard.max_bad_steps, cfg.guard.dist_timeout_min) == (0, 15)
    with pytest.raises(ConfigError, match="max_bad_steps must be >= 0"):
        build_config(cls, ["--max_bad_steps", "-1"])
    with pytest.raises(ConfigError, match="dist_timeout_min must be >= 1"):
        build_config(cls, ["--dist_timeout_min", "0"])


def test_config_yaml_masks_reward_url_secrets():
    url = "https://bob:hunter2@rm.example/score?api_key=K123"
    cfg, _ = build_config(
        PPOConfig, ["--remote_rm_url", url, "--remote_rm_auth_env", "RM_TOKEN", "--pretrain", "m"]
    )
    text = dump_yaml(cfg)
    assert "hunter2" not in text and "K123" not in text and "bob" not in text
    models = yaml.safe_load(text)["models"]
    assert models["remote_rm_url"] == "https://***@rm.example/score?api_key=***"
    assert models["remote_rm_auth_env"] == "RM_TOKEN"  # the name, never the value
    assert models["pretrain"] == "m"
    cfg, _ = build_config(PPOConfig, ["--remote_rm_url", "/data/r.py"])
    assert yaml.safe_load(dump_yaml(cfg))["models"]["remote_rm_url"] == "/data/r.py"
