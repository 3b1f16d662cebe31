"""Benchmark sizes, the locally built model and the synthetic data both trainers read."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

from fsdp_rlhf.testing.synthetic import NEGATIVE, NEUTRAL, POSITIVE, write_jsonl, write_reward_file
from fsdp_rlhf.testing.tiny import build_model


@dataclass(frozen=True)
class Sizes:
    """Everything that sets the amount of work. Both sides of a comparison get the same."""

    hidden: int
    layers: int
    heads: int  # head_dim = hidden / heads must be 64 (vLLM CPU attention)
    intermediate: int
    vocab: int
    nproc: int  # ranks of every comparison run
    reps: int  # interleaved repetitions (A B A B ...)
    # reward-model training
    rm_pairs_per_step: int
    rm_micro: int  # pairs per forward/backward per rank
    rm_steps: int
    rm_warmup: int  # steps left out of the steady-state window
    rm_reply_words: tuple[int, int]
    # RL step
    rl_prompts: int  # prompts per step, global
    rl_n: int  # samples per prompt (GRPO group size)
    rl_resp_len: int  # max new tokens
    rl_micro: int  # sequences per forward/backward per rank
    rl_steps: int
    rl_warmup: int
    lora_rank: int  # the LoRA row's adapter rank (0: no LoRA row)
    prompt_words: tuple[int, int]
    cells: tuple[str, ...]  # "<bf16|fp32>+<tcmalloc|glibc>" of the matrix; the first is primary
    real_shaped: bool  # also run the primary cell on a Llama-shaped model (GQA 9/3, tied)
    extra_runs: bool  # with --more: PPO with critic, HF rollouts, scaling, RM variants
    offline_rows: bool = True  # SFT and DPO against TRL in the primary cell (benchkit.offline)

    def to_dict(self) -> dict:
        return asdict(self)


CELLS = ("bf16+tcmalloc", "bf16+glibc", "fp32+tcmalloc", "fp32+glibc")

# About 34M parameters: big enough that matmuls dominate a step on these CPUs, small enough
# that the matrix (4 cells x 2 workloads x 2 sides x 2 repetitions, plus the Llama-shaped row
# and the LoRA runs) fits the 25 minutes issue #15 allows on 2 cores; step counts are short for
# that. Two warm-up steps on both sides: our first step compiles (--torch_compile; vLLM's
# compiled model comes from its cache), and the second is still slower than the steady ones for
# our RM; TRL's steps are steady from the second. All start-up costs stay outside the window.
FULL = Sizes(
    hidden=512,
    layers=8,
    heads=8,
    intermediate=2048,
    vocab=512,
    nproc=2,
    reps=2,
    rm_pairs_per_step=16,
    rm_micro=8,
    rm_steps=6,
    rm_warmup=2,
    rm_reply_words=(16, 128),
    rl_prompts=8,
    rl_n=4,
    rl_resp_len=64,
    rl_micro=8,
    rl_steps=4,
    rl_warmup=2,
    lora_rank=16,
    prompt_words=(16, 48),
    cells=CELLS,
    real_shaped=True,
    extra_runs=True,
)
# Tiny and short: checks that every path runs and writes sane numbers, not speed.
SMOKE = Sizes(
    hidden=128,
    layers=2,
    heads=2,
    intermediate=256,
    vocab=512,
    nproc=2,
    reps=1,
    rm_pairs_per_step=8,
    rm_micro=4,
    rm_steps=3,
    rm_warmup=1,
    rm_reply_words=(4, 16),
    rl_prompts=4,
    rl_n=2,
    rl_resp_len=8,
    rl_micro=4,
    rl_steps=2,
    rl_warmup=1,
    lora_rank=4,
    prompt_words=(4, 8),
    cells=("bf16+tcmalloc", "fp32+glibc"),
    real_shaped=False,
    extra_runs=False,
    offline_rows=False,
)


def _words(rng: random.Random, flavour: list[str], lo: int, hi: int) -> str:
    # Mostly neutral words with some flavoured ones, as in fsdp_rlhf.testing.synthetic.
    n = rng.randint(lo, hi)
    return " ".join(
        rng.choice(flavour) if rng.random() < 0.3 else rng.choice(NEUTRAL) for _ in range(n)
    )


def pair_rows(n: int, sizes: Sizes, seed: int = 0) -> list[dict[str, str]]:
    """Full-text pairs (``chosen``/``rejected``, no prompt column): TRL's implicit-prompt
    format and ours without ``--prompt_key``, so both tokenize exactly the same strings."""
    rng = random.Random(seed)
    lo, hi = sizes.rm_reply_words
    rows = []
    for _ in range(n):
        prompt = f"Human: {_words(rng, NEUTRAL, *sizes.prompt_words)}\nAssistant: "
        rows.append(
            {
                "chosen": prompt + _words(rng, POSITIVE, lo, hi),
                "rejected": prompt + _words(rng, NEGATIVE, lo, hi),
            }
        )
    return rows


def prompt_rows(n: int, sizes: Sizes, seed: int = 1) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"input": _words(rng, NEUTRAL, *sizes.prompt_words)} for _ in range(n)]


@dataclass(frozen=True)
class Workload:
    model: Path
    pairs: Path
    prompts: Path
    reward_py: Path
    params_m: float
    arch: str = "qwen2"


def rm_rows_needed(sizes: Sizes) -> int:
    """Rows such that ``train-rm`` runs exactly ``rm_steps`` steps after holding out its eval
    set (1%, at least 8 pairs; fsdp_rlhf.data.preference.hold_out)."""
    n = sizes.rm_steps * sizes.rm_pairs_per_step
    while (n - min(max(-(-n // 100), 8), n // 2)) // sizes.rm_pairs_per_step < sizes.rm_steps:
        n += 1
    return n


# Llama-family shape as published small checkpoints have it (SmolLM-135M: hidden 576, 9 query
# and 3 KV heads, tied embeddings), at the depth and FFN of the Qwen2 workload's size class.
LLAMA_SHAPE = dict(hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536)


def build_workload(root: Path, sizes: Sizes, arch: str = "qwen2") -> Workload:
    """The model (Qwen2 at ``sizes``, or the Llama shape above with ``sizes.layers``), pairs,
    prompts and rule reward under ``root``."""
    if arch == "qwen2":
        shape = dict(hidden_size=sizes.hidden, num_heads=sizes.heads,
                     intermediate_size=sizes.intermediate)  # fmt: skip
    else:
        shape = {**LLAMA_SHAPE, "tie_word_embeddings": True}
    model = build_model(
        root / "model", arch, num_layers=sizes.layers, vocab_size=sizes.vocab, **shape
    )
    pairs = write_jsonl(pair_rows(rm_rows_needed(sizes), sizes), root / "pairs.jsonl")
    n_prompts = max(256, sizes.rl_prompts * (sizes.rl_steps + 1))
    prompts = write_jsonl(prompt_rows(n_prompts, sizes), root / "prompts.jsonl")
    reward_py = write_reward_file(root / "reward.py", "positive")
    return Workload(model, pairs, prompts, reward_py, _params_m(model), arch)


def _params_m(model: Path) -> float:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for key in f.keys():
            n = 1
            for d in f.get_slice(key).get_shape():
                n *= d
            total += n
    return total / 1e6
