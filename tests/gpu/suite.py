"""What the GPU suite's checks share: what this machine has, sizes, the model, the CLI runs, and
the doctor's per-phase estimate beside the measured peaks.

Runs from the source tree on a bare GPU box (docs/gpu.md): nothing is installed or fetched, the
models are built here with random weights. Without vLLM the PPO steps and doctor run with
``--rollout_engine hf``; without flash-attn the packed path uses SDPA. On CPU the CLI steps run
as a rehearsal at tiny sizes on 2 gloo ranks, where the model's first dimensions (vocabulary, MLP
width) do not divide the world size.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
SUITE_START = time.monotonic()


def available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that refuses it (how CI hides vLLM)
        return False


HAVE = {
    "cuda": torch.cuda.is_available(),
    "vllm": available("vllm"),
    "flash_attn": available("flash_attn"),
}
WHY = {
    "cuda": "needs CUDA",
    "vllm": "needs vLLM (not installed here: rollouts use --rollout_engine hf)",
    "flash_attn": "needs flash-attn (not installed here: packing uses SDPA varlen)",
}
# CUDA: one GPU, one rank. CPU (the rehearsal): 2 gloo ranks, tiny sizes.
WORLD = 1 if HAVE["cuda"] else 2
# Shapes with first dimensions that do not divide 2 (or 3) ranks: a 499-token vocabulary (BPE
# trained to at most 509) and an
# MLP width of 333; heads of 64 (vLLM's CPU attention needs 64).
SIZES = {
    "cuda": dict(hidden=576, heads=9, kv_heads=3, inter=1533, layers=4, vocab=509, micro=4,
                 prompt=64, response=32, batch=16, length=256),
    "cpu": dict(hidden=192, heads=3, kv_heads=1, inter=333, layers=2, vocab=509, micro=4,
                prompt=32, response=8, batch=4, length=48),
}[("cuda" if HAVE["cuda"] else "cpu")]  # fmt: skip
# seconds one CLI run may take (the whole suite stays under 10 minutes on one H100)
CLI_TIMEOUT = 240


def engine_flags() -> list[str]:
    """vLLM where it is installed and can run (CUDA), else the HF engine (the box)."""
    return [] if HAVE["vllm"] and HAVE["cuda"] else ["--rollout_engine", "hf"]


def build_odd_model(out: Path) -> str:
    from fsdp_rlhf.testing.tiny import build_model

    s = SIZES
    path = build_model(
        out,
        "qwen2",
        hidden_size=s["hidden"],
        num_heads=s["heads"],
        num_kv_heads=s["kv_heads"],
        intermediate_size=s["inter"],
        num_layers=s["layers"],
        vocab_size=s["vocab"],
    )
    return str(path)


def first_dims(path: str) -> dict[str, int]:
    config = json.loads((Path(path) / "config.json").read_text())
    return {k: config[k] for k in ("vocab_size", "intermediate_size", "hidden_size")}


def cli(args: list[str], nproc: int = WORLD, timeout: int = CLI_TIMEOUT, env: dict | None = None):
    """``torchrun -m fsdp_rlhf.cli ARGS`` from the source tree; the child sees this tree first
    on PYTHONPATH (and whatever the caller's PYTHONPATH carries: the box's wheels), and
    ``env`` on top of this process's environment."""
    from fsdp_rlhf.testing.launch import local_torchrun

    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    cmd = local_torchrun(nproc, ["-m", "fsdp_rlhf.cli", *args])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        log = results_dir() / f"{args[0]}-{os.getpid()}-{time.monotonic_ns()}.log"
        log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        # the job's own last lines, not torchrun's summary of the failure that follows them
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        cut = next((i for i, x in enumerate(lines) if "ChildFailedError" in x), len(lines))
        tail = [x for x in lines[:cut] if x.strip() and not x.startswith("[W")][-12:]
        raise AssertionError(
            f"{args[0]} exited {proc.returncode} (whole log: {log}):\n" + "\n".join(tail)
        )
    return proc


def metrics(save_path: Path) -> list[dict]:
    lines = (save_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def ppo_flags(model: str, root: Path, sizes: dict, steps: int = 2) -> list[str]:
    """Flags of a small PPO job with a critic and a rule reward (``steps`` 0: no step limit,
    for doctor)."""
    from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl, write_reward_file

    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(prompt_rows(64), root / "prompts.jsonl")
    write_reward_file(root / "reward.py")
    return [
        "--pretrain", model, "--critic_pretrain", model,
        "--remote_rm_url", str(root / "reward.py"), "--prompt_data", str(root / "prompts.jsonl"),
        "--input_key", "input", "--rollout_batch_size", "8", "--n_samples_per_prompt", "2",
        "--train_batch_size", "16", "--micro_train_batch_size", str(sizes["micro"]),
        "--micro_rollout_batch_size", str(sizes["micro"]),
        "--prompt_max_len", str(sizes["prompt"]), "--generate_max_len", str(sizes["response"]),
        "--save_path", str(root / "out"), *engine_flags(),
        *(["--max_steps", str(steps)] if steps else []),
    ]  # fmt: skip


# doctor's phases (distributed.memory) and the trainer's timed phases they cover (the rollout:
# the weight sync, then generation)
MEASURED_PHASES = {
    "rollout": ("resharding_to_infer", "rollout"),
    "scoring (no-grad)": ("old_log_p", "reference_model", "critic_model", "reward_model"),
    "actor update": ("update",),
    "critic update": ("update_critic",),
}
MEMORY_TOLERANCE = 0.10


def compare_phases(phases, row: dict) -> list[dict]:
    """Doctor's per-phase estimate beside the measured peaks of one step's metrics.

    The estimate's tensors (its total less the CUDA context, which the allocator does not see,
    and the allocator's slack, reserved but not allocated) are compared with
    ``max_memory_allocated``; ``memory_reserved`` and the device's used memory (``mem_get_info``,
    at the phase's end) are shown beside them."""
    rows = []
    for phase in phases:
        timers = [t for t in MEASURED_PHASES.get(phase.name, ()) if f"memory/{t}_gib" in row]
        if not timers:
            continue

        def peak(prefix: str, timers=timers) -> float | None:
            vals = [row[f"{prefix}/{t}_gib"] for t in timers if f"{prefix}/{t}_gib" in row]
            return max(vals) if vals else None

        outside = ("cuda context + nccl", "allocator slack")
        tensors = (phase.total - sum(phase.parts.get(k, 0) for k in outside)) / GIB
        allocated = peak("memory")
        rows.append(
            dict(
                phase=phase.name,
                estimate_gib=phase.total / GIB,
                estimate_tensors_gib=tensors,
                allocated_gib=allocated,
                reserved_gib=peak("memory_reserved"),
                device_used_gib=peak("memory_device_used"),
                error=(tensors - allocated) / allocated if allocated else math.inf,
            )
        )
    return rows


def census_env() -> dict[str, str]:
    """A CLI run's environment that takes the memory census (``distributed.memory_census``) at
    the end of every timed phase the estimate is compared with."""
    timers = sorted({t for ts in MEASURED_PHASES.values() for t in ts})
    return {"FSDP_RLHF_MEMORY_CENSUS": ",".join(timers)}


def census_rows(row: dict) -> dict[str, dict[str, float]]:
    """One step's census from its metrics: ``{timer: {owner: GiB}}``, in the estimate's phase
    order (``memory_owner/<timer>/<owner>_gib``)."""
    out: dict[str, dict[str, float]] = {}
    for timers in MEASURED_PHASES.values():
        for timer in timers:
            prefix = f"memory_owner/{timer}/"
            owners = {
                k[len(prefix) : -len("_gib")].replace("_", " "): v
                for k, v in row.items()
                if k.startswith(prefix)
            }
            if owners:
                out[timer] = owners
    return out


def format_census(census: dict[str, dict[str, float]]) -> list[str]:
    """Lines of bytes by owner at each phase's end (GiB, or MiB below 0.1 GiB); owners holding
    nothing there are left out."""

    def size(gib: float) -> str:
        return f"{gib:.2f} GiB" if abs(gib) >= 0.1 else f"{gib * 1024:.1f} MiB"

    out = []
    for timer, owners in census.items():
        held = ", ".join(f"{k} {size(v)}" for k, v in owners.items() if v)
        out.append(f"end of {timer}: {held or 'nothing'}")
    return out


def format_rows(rows: list[dict], measured: str = "max allocated") -> list[str]:
    def gib(v):
        return "-" if v is None else f"{v:.2f}"

    out = [f"phase | estimate (tensors) GiB | {measured} | max reserved | device used | error"]
    for r in rows:
        out.append(
            f"{r['phase']} | {gib(r['estimate_gib'])} ({gib(r['estimate_tensors_gib'])}) | "
            f"{gib(r['allocated_gib'])} | {gib(r['reserved_gib'])} | {gib(r['device_used_gib'])} "
            f"| {r['error']:+.0%}"
        )
    return out


def device_bytes() -> int:
    """What the doctor plans against: the GPU's memory, or this host's RAM."""
    if HAVE["cuda"]:
        return torch.cuda.mem_get_info()[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def estimate_beside_measured(flags: list[str], row: dict, world: int = WORLD) -> list[str]:
    """The doctor's plan for ``flags`` beside the peaks of one step's metrics ``row``."""
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.distributed.memory_plan import plan_job

    cfg = build_config(PPOConfig, flags)[0]
    phases = plan_job(cfg, world, device_bytes(), cuda=HAVE["cuda"])
    measured = "max allocated" if HAVE["cuda"] else "host peak RSS (CPU rehearsal)"
    return format_rows(compare_phases(phases, row), measured)


def unmet_requirements(dist: str, seen: set[str] | None = None) -> list[str]:
    """``dist``'s requirements (no extras), and theirs, that the installed packages do not
    meet: read from the packages' metadata, so nothing is imported."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen = set() if seen is None else seen
    bad = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            bad.append(f"{req.name} missing (needed by {dist})")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name} {have} (needs {req.specifier}, for {dist})")
        elif name not in seen:
            seen.add(name)
            bad += unmet_requirements(req.name, seen)
    return bad


def require(*needs: str) -> None:
    """Skip the calling check, naming the first thing this machine lacks."""
    import pytest

    missing = [n for n in needs if not HAVE[n]]
    if missing:
        pytest.skip(WHY[missing[0]])


def build_big_model(out: Path) -> str:
    """Qwen2.5-1.5B's shape (28 layers, hidden 1536, 12/2 heads, 151,936 vocabulary, tied
    embeddings; no head_dim key), random bf16 weights, initialised on the GPU: big enough that
    fixed costs do not dominate the phases' memory or the speed checks' timings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_rlhf.testing.tiny import _drop_config_keys, build_tokenizer, write_generation_config

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = Qwen2Config(
        vocab_size=151_936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()
    _drop_config_keys(out, ("head_dim",))
    write_generation_config(out, tok)
    return str(out)


def results_dir() -> Path:
    """Where checks write their dated JSON (``FSDP_RLHF_GPU_SUITE_OUT``, e.g. the device
    tool's ``$OUT``; else a temporary folder)."""
    import tempfile

    out = Path(os.environ.get("FSDP_RLHF_GPU_SUITE_OUT") or tempfile.gettempdir())
    out.mkdir(parents=True, exist_ok=True)
    return out
