"""Every flag OpenRLHF's parsers define ends in one of three ways: it takes effect, it is
accepted as what we do anyway, or it is refused by name with a reason. Never "unknown flag"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_rlhf.commands import WITH_OWN_FLAGS
from fsdp_rlhf.compat import translate
from fsdp_rlhf.compat.openrlhf import TABLES, VERSIONS
from fsdp_rlhf.compat.rules import Accept, Refuse
from fsdp_rlhf.config_base import ConfigError, build_config, parse_cli, split_flags

DATA = Path(__file__).resolve().parents[2] / "fsdp_rlhf" / "compat" / "data"
CONFIGS = {c.name: c.config_class() for c in WITH_OWN_FLAGS}


def _flags(parser: str, version: str) -> list[dict]:
    doc = json.loads((DATA / f"openrlhf-{version}-{parser}.json").read_text())
    assert doc["openrlhf"].lstrip("v") == version
    return doc["flags"]


def _sample(flag: dict) -> list[str]:
    """A value OpenRLHF would accept for this flag (its default where it has one)."""
    if flag["type"] == "bool":
        return []
    default = flag.get("default")
    nargs = flag.get("nargs")
    if isinstance(default, list | tuple) and default:
        return [str(v) for v in default]
    if default not in (None, "", {}) and not isinstance(default, dict):
        return [str(default)]
    if flag.get("choices"):
        return [str(flag["choices"][0])]
    one = {"int": "1", "float": "1.0"}.get(flag["type"], "x")
    return [one] * (2 if nargs == 2 else 1)


CASES = [
    (command.name, version, flag)
    for command in WITH_OWN_FLAGS
    for parser in command.openrlhf
    for version in VERSIONS
    for flag in _flags(parser, version)
]


def _outcome(command: str, argv: list[str]) -> str:
    """'effect', 'accepted' or 'refused' (raises on anything else)."""
    try:
        translation = translate(command, argv)
    except ConfigError as e:
        assert argv[0] in str(e) or argv[0].lstrip("-") in str(e), str(e)
        assert "not supported here" in str(e) or "must" in str(e) or "use" in str(e), str(e)
        return "refused"
    if not translation.argv:
        assert translation.notes and "accepted" in translation.notes[0]
        return "accepted"
    parse_cli(CONFIGS[command], translation.argv)  # raises ConfigError on an unknown flag
    return "effect"


@pytest.mark.parametrize(
    "command,version,flag",
    CASES,
    ids=[f"{c}-{v}-{f['names'][0]}" for c, v, f in CASES],
)
def test_every_openrlhf_flag_has_an_outcome(command, version, flag):
    name = flag["names"][0]
    if name == "--local_rank":  # torch.distributed.launch's; parse_cli skips it
        return
    assert _outcome(command, [name, *_sample(flag)]) in ("effect", "accepted", "refused")


def test_the_walk_covers_both_versions_of_both_parsers():
    counts = {(c, v): sum(1 for cc, vv, _ in CASES if (cc, vv) == (c, v)) for c, v, _ in CASES}
    assert counts == {
        ("ppo", "0.10.1.post2"): 144,
        ("ppo", "0.11.0"): 164,
        ("train-rm", "0.10.1.post2"): 70,
        ("train-rm", "0.11.0"): 79,
        ("sft", "0.10.1.post2"): 69,
        ("sft", "0.11.0"): 77,
        ("dpo", "0.10.1.post2"): 74,
        ("dpo", "0.11.0"): 82,
        # 0.11.1: + --algo.kl.unbiased_gradient; 0.11.2: IS correction as level/mode/gating
        # (the switch and type gone), --actor.loss_agg_mode; train_rm/sft/dpo unchanged
        ("ppo", "0.11.1"): 165,
        ("ppo", "0.11.2"): 167,
        ("train-rm", "0.11.1"): 79,
        ("train-rm", "0.11.2"): 79,
        ("sft", "0.11.1"): 77,
        ("sft", "0.11.2"): 77,
        ("dpo", "0.11.1"): 82,
        ("dpo", "0.11.2"): 82,
    }


def test_refused_flags_say_why_and_what_instead():
    for argv, words in (
        (["--vllm.sync_with_ray"], "no Ray"),
        (["--vllm_generate_batch_size", "64", "--rollout_batch_size", "32"], "async"),
        (["--ds.zpg", "8"], "HSDP"),
        (["--param_dtype", "fp16"], "bf16"),
        (["--actor.optim", "muon"], "Muon"),
        (["--ds_tensor_parallel_size", "2"], "tensor parallelism"),
    ):
        with pytest.raises(ConfigError, match=words) as e:
            translate("ppo", argv)
        assert argv[0] in str(e.value)


def test_ring_attention_flags_become_sequence_parallelism():
    """OpenRLHF's ring-attention size takes effect as Ulysses sequence parallelism (both
    spellings, every command); the head stride is accepted with the note that there is no
    ring to stride through."""
    for command in ("ppo", "train-rm", "sft", "dpo"):
        for size, stride in (
            ("--ring_attn_size", "--ring_head_stride"),
            ("--ds.ring_attn_size", "--ds.ring_attn_head_stride"),
        ):
            t = translate(command, [size, "2", stride, "2"])
            assert t.argv == ["--sequence_parallel_size", "2"], (command, t.argv)
            assert any("Ulysses all-to-all, not a ring" in n for n in t.notes), t.notes
            assert any(n.startswith(f"{stride} 2: accepted") for n in t.notes), t.notes
            assert _cfg(command, size, "2").fsdp.sequence_parallel_size == 2


def test_values_of_accepted_flags_that_describe_something_else_are_refused():
    assert translate("ppo", ["--ds.zpg", "1"]).argv == []


def test_vlm_flags_translate_in_both_dialects():
    ours = ["--image_key", "images", "--max_images_per_prompt", "2", "--freeze_visual_encoder"]
    dotted = ["--data.image_key", "images", "--data.max_images_per_prompt", "2"]
    assert translate("ppo", [*dotted, "--actor.freeze_visual_encoder"]).argv == ours
    assert translate("ppo", ours).argv == ours
    cfg = _cfg("ppo", *dotted, "--actor.freeze_visual_encoder").vision
    assert (cfg.image_key, cfg.max_images_per_prompt, cfg.freeze_visual_encoder) == (
        "images",
        2,
        True,
    )


def _cfg(command: str, *argv: str):
    return build_config(CONFIGS[command], translate(command, list(argv)).argv)[0]


def test_dotted_and_flat_spellings_set_the_same_config():
    flat = _cfg(
        "ppo",
        *("--pretrain", "m", "--ref_num_nodes", "2", "--actor_num_nodes", "2"),
        *("--actor_num_gpus_per_node", "4", "--ref_num_gpus_per_node", "4"),
        *("--colocate_all_models", "--vllm_sync_backend", "nccl", "--zero_stage", "3"),
        *("--param_dtype", "bf16", "--advantage_estimator", "group_norm"),
        *("--init_kl_coef", "0.001", "--use_kl_loss", "--kl_estimator", "k3"),
        *("--actor_learning_rate", "5e-7", "--rollout_batch_size", "64"),
        *("--n_samples_per_prompt", "8", "--max_len", "3072", "--max_new_tokens", "1024"),
        *("--enable_vllm_is_correction", "--vllm_is_correction_type", "icepop"),
        *("--reward_clip_range", "-5", "5", "--prompt_data", "p", "--input_key", "q"),
        *("--use_tensorboard", "tb", "--save_path", "out", "--ckpt_path", "ck"),
    )
    dotted = _cfg(
        "ppo",
        *("--actor.model_name_or_path", "m", "--ref.num_nodes", "2", "--actor.num_nodes", "2"),
        *("--actor.num_gpus_per_node", "4", "--ref.num_gpus_per_node", "4"),
        *("--train.colocate_all", "--vllm.sync_backend", "nccl", "--ds.zero_stage", "3"),
        *("--ds.param_dtype", "bf16", "--algo.advantage.estimator", "group_norm"),
        *("--algo.kl.init_coef", "0.001", "--algo.kl.use_loss", "--algo.kl.estimator", "k3"),
        *("--actor.adam.lr", "5e-7", "--rollout.batch_size", "64"),
        *("--rollout.n_samples_per_prompt", "8", "--data.max_len", "3072"),
        *("--rollout.max_new_tokens", "1024"),
        *("--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "icepop"),
        *("--reward.clip_range", "-5", "5", "--data.prompt_dataset", "p"),
        *("--data.input_key", "q", "--logger.tensorboard_dir", "tb"),
        *("--ckpt.output_dir", "out", "--ckpt.path", "ck"),
    )
    assert flat == dotted
    assert (flat.placement.num_nodes, flat.placement.num_gpus_per_node) == (2, 4)
    assert flat.fsdp.zero_stage == 3 and flat.backend.bf16
    assert flat.algo.advantage_estimator == "grpo" and flat.algo.kl_estimator == "k3"
    assert flat.actor_optim.lr == 5e-7 and flat.critic_optim.lr == 9e-6
    assert (flat.data.prompt_max_len, flat.rollout.generate_max_len) == (2048, 1024)
    assert flat.algo.is_correction == "icepop" and flat.algo.reward_clip_range == 5.0
    assert flat.logging.tensorboard == "tb" and flat.ckpt.ckpt_path == "ck"


def test_rm_dialects_set_the_same_config():
    flat = _cfg(
        "train-rm",
        *("--pretrain", "m", "--dataset", "d", "--max_len", "1024", "--zero_stage", "3"),
        *("--learning_rate", "9e-6", "--param_dtype", "bf16", "--margin_loss"),
        *("--chosen_key", "c", "--rejected_key", "r", "--train_batch_size", "64"),
        *("--micro_train_batch_size", "4", "--adam_betas", "0.9", "0.98", "--l2", "0.1"),
    )
    dotted = _cfg(
        "train-rm",
        *("--model.model_name_or_path", "m", "--data.dataset", "d", "--data.max_len", "1024"),
        *("--ds.zero_stage", "3", "--adam.lr", "9e-6", "--ds.param_dtype", "bf16"),
        *("--model.margin_loss_enable", "--data.chosen_key", "c", "--data.rejected_key", "r"),
        *("--train.batch_size", "64", "--train.micro_batch_size", "4"),
        *("--adam.betas", "0.9", "0.98", "--adam.weight_decay", "0.1"),
    )
    assert flat == dotted
    assert flat.data.margin_key == "margin" and flat.optim.adam_betas == (0.9, 0.98)
    assert flat.optim.l2 == 0.1 and flat.batch.micro_train_batch_size == 4


def test_placement_on_separate_pools_is_refused():
    with pytest.raises(ConfigError, match="separate node pools"):
        translate("ppo", ["--actor_num_nodes", "2", "--ref_num_nodes", "1"])
    with pytest.raises(ConfigError, match="separate node pools"):
        translate("ppo", ["--actor.num_gpus_per_node", "8", "--critic.num_gpus_per_node", "4"])


def test_max_len_alone_gives_each_response_what_its_prompt_leaves():
    cfg = _cfg("ppo", "--max_len", "512")
    assert cfg.rollout.max_len == 512
    assert cfg.rollout.generate_max_len == 511 and cfg.data.prompt_max_len == 511
    assert cfg.total_len == 512
    from fsdp_rlhf.rollout.engine import SamplingConfig

    sampling = SamplingConfig.from_rollout_config(cfg.rollout, n=1)
    assert [sampling.budget(p) for p in (10, 500, 511, 600)] == [502, 12, 1, 1]
    with pytest.raises(ConfigError, match="must exceed"):
        translate("ppo", ["--max_len", "100", "--max_new_tokens", "100"])


def test_an_openrlhf_async_script_with_an_is_correction_keeps_openrlhfs_ratio():
    """OpenRLHF weighs its trainer's old log-probs against the engine's and takes the PPO ratio
    against the old ones, under async training too: a script that sets its IS correction keeps
    that (the translation says so); one that sets none gets this trainer's async default."""
    from fsdp_rlhf.config.ppo import AUTO_OFF_POLICY

    for spelled in (
        ("--async_train", "--enable_vllm_is_correction", "--vllm_is_correction_type", "icepop"),
        ("--train.async_enable", "--algo.advantage.is_correction_level", "token"),
    ):
        argv = [*spelled, "--vllm_num_engines", "1"]
        assert "--off_policy_correction none" in " ".join(translate("ppo", argv).argv)
        algo = _cfg("ppo", *argv).algo
        assert (algo.is_correction, algo.off_policy_correction) == ("icepop", "none")
    algo = _cfg("ppo", "--train.async_enable", "--vllm_num_engines", "1").algo
    assert algo.off_policy_correction == AUTO_OFF_POLICY["async"]


def test_is_correction_type_without_the_switch_does_nothing_as_in_openrlhf():
    assert _cfg("ppo", "--vllm_is_correction_type", "icepop").algo.is_correction == "none"
    assert _cfg("ppo", "--enable_vllm_is_correction").algo.is_correction == "tis"
    cfg = _cfg(
        "ppo",
        *("--enable_vllm_is_correction", "--vllm_is_correction_type", "seq-mask-tis"),
        *("--vllm_is_truncated_threshold", "0.5", "2"),
    )
    # OpenRLHF's seq-mask-tis keeps the untruncated ratio on the rows it keeps: our seq_mask
    assert (cfg.algo.is_correction, cfg.algo.is_truncated_threshold) == ("seq_mask", (0.5, 2))


IS_0_11_0 = "--algo.advantage.is_correction_enable --algo.advantage.is_correction_type"
IS_0_11_2 = "--algo.advantage.is_correction_level {} --algo.advantage.is_correction_mode {}"


@pytest.mark.parametrize(
    ("type_", "level", "mode", "ours"),
    [
        ("tis", "token", "clip", "tis"),
        ("icepop", "token", "mask", "icepop"),
        ("seq-mask-tis", "seq", "mask", "seq_mask"),
    ],
)
def test_is_correction_in_openrlhf_0_11_0_and_0_11_2_spellings(type_, level, mode, ours):
    """OpenRLHF's own table (0.11.2's help): TIS = token clip, ICEPOP = token mask,
    seq-mask-tis = seq mask. The flat, 0.11.0 and 0.11.2 spellings set one config."""
    threshold = ("--algo.advantage.is_correction_threshold", "0.4", "3")
    flat = _cfg("ppo", "--enable_vllm_is_correction", "--vllm_is_correction_type", type_,
                "--vllm_is_truncated_threshold", "0.4", "3")  # fmt: skip
    old = _cfg("ppo", *IS_0_11_0.split(), type_, *threshold)
    new = _cfg("ppo", *IS_0_11_2.format(level, mode).split(), *threshold)
    assert flat == old == new
    assert (new.algo.is_correction, new.algo.is_truncated_threshold) == (ours, (0.4, 3.0))
    assert new.algo.is_correction_gating == "ratio"


def test_is_correction_0_11_2_defaults_and_the_flashreinforce_trust_region():
    # level token alone: OpenRLHF's default mode is mask (ICEPOP); threshold default 0.5 5
    algo = _cfg("ppo", "--algo.advantage.is_correction_level", "token").algo
    assert (algo.is_correction, algo.is_truncated_threshold) == ("icepop", (0.5, 5.0))
    # level off (the default): mode and gating change nothing, as there
    off = ("--algo.advantage.is_correction_level", "off", "--algo.advantage.is_correction_gating")
    assert _cfg("ppo", *off, "tv").algo == _cfg("ppo").algo
    assert _cfg("ppo", "--algo.advantage.is_correction_mode", "clip").algo == _cfg("ppo").algo
    # FlashREINFORCE: seq + mask + binary_kl with one threshold, an upper bound
    algo = _cfg(
        "ppo",
        *("--algo.advantage.is_correction_level", "seq"),
        *("--algo.advantage.is_correction_gating", "binary_kl"),
        *("--algo.advantage.is_correction_threshold", "5e-3"),
    ).algo
    assert (algo.is_correction, algo.is_correction_gating) == ("seq_mask", "binary_kl")
    assert algo.is_truncated_threshold == (0.0, 5e-3)
    tv = _cfg("ppo", *IS_0_11_2.format("token", "mask").split(),
              "--algo.advantage.is_correction_gating", "tv",
              "--algo.advantage.is_correction_threshold", "0", "0.2").algo  # fmt: skip
    assert (tv.is_correction, tv.is_correction_gating, tv.is_truncated_threshold) == (
        "icepop",
        "tv",
        (0.0, 0.2),
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        # clip clamps the token ratio only (OpenRLHF raises the same)
        (IS_0_11_2.format("seq", "clip"), "is_correction_mode clip: not supported here"),
        (
            IS_0_11_2.format("token", "clip") + " --algo.advantage.is_correction_gating tv",
            "is_correction_mode clip: not supported here",
        ),
        # a divergence is bounded from above only; OpenRLHF's default band 0.5 5 is refused
        (
            "--algo.advantage.is_correction_level seq --algo.advantage.is_correction_gating "
            "binary_kl",
            "bounds a divergence from above only",
        ),
        # the two releases' spellings on one line
        (
            "--algo.advantage.is_correction_enable --algo.advantage.is_correction_level token",
            "use one release's flags",
        ),
        ("--algo.advantage.is_correction_level tokens", "expected one of off, token, seq"),
    ],
)
def test_is_correction_combinations_openrlhf_refuses_are_refused_by_name(argv, words):
    with pytest.raises(ConfigError, match=words):
        _cfg("ppo", *argv.split())


def test_flash_reinforce_flags_of_openrlhf_0_11_2():
    """The optimizer flags of OpenRLHF's train_flash_reinforce_ray_agent_async.sh."""
    algo = _cfg(
        "ppo",
        *("--algo.advantage.estimator", "flash_reinforce"),
        *("--algo.advantage.is_correction_level", "seq"),
        *("--algo.advantage.is_correction_gating", "binary_kl"),
        *("--algo.advantage.is_correction_threshold", "5e-3"),
        *("--actor.loss_agg_mode", "seq-mean-token-mean"),
        *("--algo.kl.init_coef", "0"),
        *("--rollout.n_samples_per_prompt", "1"),
    ).algo
    assert algo.advantage_estimator == "flash_reinforce"
    assert algo.loss_agg_mode == "seq-mean-token-mean" and algo.init_kl_coef == 0
    assert (algo.is_correction, algo.is_correction_gating) == ("seq_mask", "binary_kl")
    # --algo.kl.unbiased_gradient (0.11.1) with the KL as a loss, and refused without it
    kl = ("--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--algo.kl.unbiased_gradient")
    assert _cfg("ppo", *kl).algo.kl_unbiased_gradient
    from fsdp_rlhf.rules import Refused, check_flags

    with pytest.raises(Refused, match="add --use_kl_loss"):  # a row of the rules table
        check_flags("ppo", _cfg("ppo", "--algo.kl.unbiased_gradient"))


def test_use_tis_is_tis_with_no_lower_bound():
    algo = _cfg("ppo", "--use_tis", "--tis_cap", "3").algo
    assert (algo.is_correction, algo.is_truncated_threshold) == ("tis", (0.0, 3.0))
    assert _cfg("ppo", "--use_tis").algo.is_truncated_threshold == (0.0, 2.0)
    with pytest.raises(ConfigError, match="use_tis"):
        translate("ppo", ["--use_tis", "--is_correction", "icepop"])
    with pytest.raises(ConfigError, match="tis_cap"):
        translate("ppo", ["--use_tis", "--tis_cap", "0"])


def test_small_mappings():
    assert _cfg("ppo", "--vllm_num_engines", "0").rollout.rollout_engine == "hf"
    assert _cfg("ppo", "--advantage_estimator", "reinforce").algo.advantage_estimator == (
        "reinforce++"
    )
    assert not _cfg("ppo", "--algo.advantage.no_std_norm").algo.advantage_std_norm
    assert not _cfg("ppo", "--no_advantage_std_norm").algo.advantage_std_norm
    assert _cfg("ppo", "--reward.overlong_buffer_len", "512.0").algo.overlong_buffer_len == 512
    assert _cfg("ppo", "--attn_implementation", "sdpa").backend.flash_attn is False
    cfg = _cfg("ppo", "--param_dtype", "bf16", "--attn_implementation", "flash_attention_2")
    assert cfg.backend.flash_attn and cfg.backend.bf16
    assert _cfg("ppo", "--deepcompile").backend.torch_compile
    assert _cfg("ppo", "--critic.adam.eps", "1e-6").critic_optim.adam_eps == 1e-6
    assert _cfg("ppo", "--actor.max_norm", "0.5").actor_optim.max_norm == 0.5
    cfg = _cfg(
        "ppo",
        "--eval.dataset",
        "e",
        "--ckpt.best_metric_key",
        "eval_default_pass4",
        "--eval.n_samples_per_prompt",
        "4",
    )
    assert cfg.eval.save_best_metric == "pass@4"
    assert _cfg("ppo", "--eval_dataset", "e", "--best_metric_key", "").eval.save_best_metric == (
        "pass@1"
    )
    assert _cfg("ppo", "--best_metric_key", "none").eval.save_best_metric is None
    with pytest.raises(ConfigError, match="symmetric"):
        translate("ppo", ["--reward_clip_range", "-1", "5"])
    # our own spelling of the same flag still works
    assert _cfg("ppo", "--reward_clip_range", "3").algo.reward_clip_range == 3.0


def test_async_flags_in_both_spellings():
    flat = _cfg(
        "ppo",
        *("--async_train", "--partial_rollout", "--async_queue_size", "2"),
        *("--rollout_batch_size", "8", "--vllm_generate_batch_size", "12"),
    )
    dotted = _cfg(
        "ppo",
        *("--train.async_enable", "--train.partial_rollout_enable"),
        *("--train.async_queue_size", "2", "--rollout.batch_size", "8"),
        *("--rollout.vllm_generate_batch_size", "12"),
    )
    assert flat == dotted
    a = flat.asynchronous
    assert (a.async_train, a.partial_rollout, a.async_queue_size) == (True, True, 2)
    assert a.vllm_generate_batch_size == 12
    # without async training, OpenRLHF's generate batch up to the rollout batch changes nothing
    assert _cfg("ppo", "--vllm_generate_batch_size", "8", "--rollout_batch_size", "8") == _cfg(
        "ppo", "--rollout_batch_size", "8"
    )
    from fsdp_rlhf.rules import Refused, check_flags

    with pytest.raises(Refused, match="add --async_train"):
        check_flags("ppo", _cfg("ppo", "--partial_rollout"))


def test_canonical_flags_typed_by_the_user_win_over_translated_ones():
    cfg = _cfg("ppo", "--ds.zero_stage", "3", "--zero_stage", "1")
    assert cfg.fsdp.zero_stage == 1


def test_every_rule_names_a_flag_of_some_parser_or_an_earlier_spelling_of_ours():
    """No stale rules: each foreign name is defined by one of the walked parsers."""
    names = {f["names"][0].lstrip("-") for _, _, f in CASES} | {"use_tis", "tis_cap"}
    # kd's: OpenRLHF's train_kd parsers, removed after 0.9.5 (tests/unit/test_kd.py walks them)
    for path in DATA.glob("openrlhf-*-kd.json"):
        names |= {f["names"][0].lstrip("-") for f in json.loads(path.read_text())["flags"]}
    for command, table in TABLES.items():
        for name in table.rules:
            assert name in names, f"{command}: rule for --{name}, which no parser defines"


def test_accept_and_refuse_rules_carry_a_reason():
    for table in TABLES.values():
        for name, rule in table.rules.items():
            if isinstance(rule, Accept | Refuse):
                assert len(rule.why) > 15, name


def test_split_flags_keeps_values_and_inline_forms():
    flags = split_flags(["--a", "1", "2", "--b", "--c=x", "--d", "-0.5"])
    assert [(f.name, f.values) for f in flags] == [
        ("a", ("1", "2")),
        ("b", ()),
        ("c", ("x",)),
        ("d", ("-0.5",)),
    ]


def test_no_rule_renames_a_flag_to_itself():
    from fsdp_rlhf.compat.rules import To

    for table in TABLES.values():
        for name, rule in table.rules.items():
            if isinstance(rule, To) and rule.shown == f"--{name}":
                # allowed only where OpenRLHF's values differ from ours
                assert name in (
                    "vllm_num_engines",
                    "reward_clip_range",
                    "overlong_buffer_len",
                    "advantage_estimator",
                ), name


def test_the_wandb_key_never_shows_in_the_start_up_notes():
    t = translate("ppo", ["--logger.wandb.key", "sk-secret-123", "--ds.zero_stage", "3"])
    assert t.argv[:2] == ["--use_wandb", "sk-secret-123"]
    assert not any("sk-secret-123" in note for note in t.notes)
    assert "--logger.wandb.key *** -> --use_wandb ***" in t.notes


def test_a_value_our_spelling_shares_needs_no_note():
    assert translate("ppo", ["--advantage_estimator", "grpo"]).notes == []
    assert translate("ppo", ["--advantage_estimator", "group_norm"]).notes != []


def test_moe_load_balancing_loss_in_both_dialects():
    assert _cfg("ppo", "--aux_loss_coef", "0.01").moe.aux_loss_coef == 0.01
    assert _cfg("ppo", "--actor.aux_loss_coef", "0.02").moe.aux_loss_coef == 0.02
    for command, flag in (("sft", "--aux_loss_coef"), ("dpo", "--model.aux_loss_coef")):
        assert translate(command, [flag, "0"]).notes  # accepted: no loss, as here
        with pytest.raises(ConfigError, match="ppo's actor only"):
            translate(command, [flag, "0.01"])


@pytest.mark.parametrize(
    "flag",
    [
        "--ep_size",
        "--expert-model-parallel-size",
        "--ds.ep_size",
        "--fsdp.ep_size",  # Molt
        "--actor.fsdp_config.turbo_config.distributed.expert_parallel_size",  # verl FSDP-Turbo
        "--expert_parallel_size",  # ours
    ],
)
def test_expert_parallel_spellings_become_expert_parallel_size(flag):
    for command in ("ppo", "sft", "dpo", "train-rm"):
        cfg = _cfg(command, flag, "2") if command == "ppo" else None
        out = translate(command, ["--pretrain", "m", flag, "2"])
        at = out.argv.index("--expert_parallel_size")
        assert out.argv[at + 1] == "2" and flag not in out.argv[:at], (command, out.argv)
        if cfg is not None:
            assert cfg.fsdp.expert_parallel_size == 2
        assert bool(out.notes) == (flag != "--expert_parallel_size"), (command, out.notes)


@pytest.mark.parametrize(
    "flag",
    ["--enable_expert_parallel", "--vllm.enable_expert_parallel", "--expert_tensor_parallel_size"],
)
def test_engine_and_expert_tensor_parallel_flags_are_refused_by_name(flag):
    for command in ("ppo", "sft"):
        with pytest.raises(ConfigError, match=rf"{flag}.*expert"):
            translate(command, ["--pretrain", "m", flag, "2"])
    kept = translate("ppo", ["--pretrain", "m", "--expert_tensor_parallel_size", "1"])
    assert "--expert_tensor_parallel_size" not in kept.argv and kept.notes
