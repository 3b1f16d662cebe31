"""Delta against full weight sync, colocated on 2 CPU ranks: bytes and time per step over GRPO
steps, and the sync's wall time with and without overlap against its parts.

``python -m scripts.benchkit.weight_sync --out benchmarks/<file>.json`` (2 local ranks).

1. ``grpo``: for each shape and engine dtype, ``fsdp-rlhf ppo`` under torchrun with
   ``--weight_sync delta`` for ``--steps`` GRPO steps at an RL learning rate (1e-6, Adam):
   per step, the share of the engine-dtype elements that changed since the last sync, the
   bytes the gathers carried (``rollout/weight_sync_wire_bytes``) against a full sync's, the
   share of changed 16-, 128- and 1024-element blocks (the changed-blocks encoding not used,
   measured through ``delta_sync.measure_blocks()``), the sync's seconds, and the engine's
   log-probs against the trainer's. bf16 is ``--bf16`` (fp32 master weights, bf16 engine);
   fp32 is the default (fp32 engine).
2. ``sync``: one torchrun job per shape and dtype (``--worker``): the FSDP2 actor beside a
   vLLM engine, then rounds of four syncs in rotating order (full, full with overlap, delta,
   delta with overlap); before each delta sync the fraction of engine-dtype elements that the
   GRPO run changed (its median) moves by one unit in the last place, at random positions.
   Per mode: wall seconds, the time making buckets (gathers, or compare + exchange + apply +
   checksum), the time the engine waited for them, and the engine's loading (wall - wait).

Shapes: ``tiny`` (the tests' Qwen2: 2 layers, hidden 128), ``bench`` (``benchkit.workload``'s:
8 layers, hidden 512, ~25M parameters), ``0.5b`` (Qwen2.5-0.5B's shape: 24 layers, hidden 896,
14/2 heads, MLP 4864, a 151,936-row tied embedding; 494M parameters). Random weights; the
tokenizer is the tests' (about 500 tokens: the other embedding rows are never input, but the
tied LM head's gradient reaches every row).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.benchkit.machine import describe

REPO = Path(__file__).resolve().parents[2]
SHAPES = {
    "tiny": dict(hidden_size=128, layers=2, heads=2, kv_heads=2, intermediate=512, vocab=None),
    "bench": dict(hidden_size=512, layers=8, heads=8, kv_heads=8, intermediate=2048, vocab=None),
    "0.5b": dict(
        hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936
    ),
}
TIED = {"tiny": False, "bench": False, "0.5b": True}
BLOCKS = "16,128,1024"
DTYPES = ("bf16", "fp32")
REWARD = (
    "def reward_func(queries, prompts, labels):\n"
    "    return [max(0.0, 1.0 - len(q[len(p):]) / 100.0) for q, p in zip(queries, prompts)]\n"
)


def build_model(out: Path, shape: str) -> Path:
    """A randomly initialised Qwen2 of ``SHAPES[shape]`` with the tests' tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_rlhf.testing.tiny import build_tokenizer, write_generation_config

    if (out / "config.json").is_file():
        return out
    s = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    config = Qwen2Config(
        vocab_size=s["vocab"] or len(tok),
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=1024,
        tie_word_embeddings=TIED[shape],
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("head_dim", None)  # like Qwen2.5's published config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_generation_config(out, tok)
    return out


def _torchrun(args: list[str], env: dict | None = None, log: Path | None = None) -> int:
    from fsdp_rlhf.testing.launch import local_torchrun

    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    with open(log or os.devnull, "w") as out:
        proc = subprocess.run(
            local_torchrun(2, args), env=full_env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    return proc.returncode


def grpo_run(model: Path, data: Path, save: Path, dtype: str, steps: int, shape: str) -> dict:
    """One delta-synced GRPO run; its per-step sync metrics."""
    small = shape == "0.5b"
    flags = [
        "--pretrain", str(model),
        "--remote_rm_url", str(data / "reward.py"),
        "--prompt_data", str(data / "prompts.jsonl"),
        "--input_key", "input",
        "--advantage_estimator", "grpo",
        "--rollout_batch_size", "4" if small else "8",
        "--n_samples_per_prompt", "4",
        "--train_batch_size", "16" if small else "32",
        "--micro_train_batch_size", "4" if small else "8",
        "--micro_rollout_batch_size", "8",
        "--packing_samples",
        "--generate_max_len", "16",
        "--prompt_max_len", "32",
        "--max_steps", str(steps),
        "--actor_learning_rate", "1e-6",
        "--lr_warmup_ratio", "0",
        "--init_kl_coef", "0",
        "--vllm_kvcache_space_gib", "0.25",
        "--save_path", str(save),
        "--save_steps", "-1",
        "--seed", "7",
        "--weight_sync", "delta",
        *(["--bf16"] if dtype == "bf16" else []),
        # 0.5b: sharded gradients and recomputed activations, to fit beside other jobs
        *(["--zero_stage", "3", "--gradient_checkpointing"] if small else []),
    ]  # fmt: skip
    t0 = time.time()
    rc = _torchrun(
        ["-m", "fsdp_rlhf.cli", "ppo", *flags],
        env={"FSDP_RLHF_MEASURE_DELTA_BLOCKS": BLOCKS},
        log=save.parent / f"{save.name}.log",
    )
    if rc != 0:
        return {"error": f"exit code {rc}, log {save.parent / (save.name + '.log')}"}
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    keep = ("weight_sync", "logprob_diff/max", "logprob_diff/mean")
    steps_out = [
        {"step": r["step"], **{k: v for k, v in r.items() if any(s in k for s in keep)}}
        for r in rows
    ]
    return {"seconds": time.time() - t0, "steps": steps_out}


def perturb(actor, dtype, frac: float, generator) -> None:
    """Move ``frac`` of the actor's elements, at random, to the next value of the engine's
    dtype (so that exactly those change in the engine's copy)."""
    import torch

    with torch.no_grad():
        for p in actor.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            flat = local.view(-1)
            pick = torch.rand(flat.numel(), generator=generator) < frac
            if not pick.any():
                continue
            if dtype == torch.bfloat16:
                bits = flat[pick].to(torch.bfloat16).view(torch.int16) + 1
                flat[pick] = bits.view(torch.bfloat16).to(flat.dtype)
            else:
                flat.view(torch.int32)[pick] += 1


def sync_worker(
    model: str, dtype_name: str, frac: float, repeats: int, out: str, master: str = "fp32"
) -> None:
    """The ``sync`` measurement on one rank of a 2-rank torchrun job. ``master``: the actor's
    own dtype (``bf16`` halves its memory; the sync then casts nothing)."""
    import torch
    import torch.distributed as dist

    from fsdp_rlhf.config import BackendConfig, FSDPConfig, RolloutConfig
    from fsdp_rlhf.distributed.delta_sync import DeltaSync
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer
    from fsdp_rlhf.rollout import build_rollout_groups, sync_weights
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    device = torch.device("cpu")
    tok = load_tokenizer(model)
    cfg = RolloutConfig(generate_max_len=16, enforce_eager=True, vllm_kvcache_space_gib=0.25)
    engine = VLLMEngine(
        model,
        cfg,
        groups=build_rollout_groups(1),
        prompt_max_len=32,
        dtype=dtype,
        seed=0,
        pad_token_id=tok.pad_token_id,
    )
    master_dtype = torch.bfloat16 if master == "bf16" else torch.float32
    actor = load_causal_lm(model, BackendConfig(), device, master_dtype)
    actor = shard_model(actor, build_mesh(device, dist.get_world_size()), FSDPConfig(), bf16=False)
    delta = DeltaSync()
    gen = torch.Generator().manual_seed(rank)
    sync_weights(actor, engine, dtype, delta=delta)  # the mirror's first, full sync
    sync_weights(actor, engine, dtype)
    modes = [("full", False), ("full", True), ("delta", False), ("delta", True)]
    rows = []
    for r in range(repeats):
        for mode, overlap in modes[r % 4 :] + modes[: r % 4]:
            if mode == "delta":
                perturb(actor, dtype, frac, gen)
            dist.barrier()
            s = sync_weights(
                actor, engine, dtype, delta=delta if mode == "delta" else None, overlap=overlap
            )
            parts = {}
            if s.delta is not None:
                d = s.delta
                parts = dict(
                    diff_s=d.diff_s, exchange_s=d.exchange_s, apply_s=d.apply_s, check_s=d.check_s
                )
            rows.append(
                dict(
                    mode=mode,
                    overlap=overlap,
                    round=r,
                    seconds=s.seconds,
                    gather_s=s.gather_s,
                    wait_s=s.wait_s,
                    load_s=s.seconds - s.wait_s,
                    wire_bytes=s.wire_bytes,
                    engine_bytes=s.bytes,
                    changed_frac=s.changed_frac,
                    **parts,
                )
            )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    engine.close()


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def summarise_sync(rows: list[dict]) -> dict:
    out = {}
    for mode in ("full", "delta"):
        for overlap in (False, True):
            sel = [r for r in rows if r["mode"] == mode and r["overlap"] == overlap]
            name = f"{mode}{' + overlap' if overlap else ''}"
            keys = ["seconds", "gather_s", "wait_s", "load_s", "wire_bytes", "engine_bytes"]
            keys += ["diff_s", "exchange_s", "apply_s", "check_s"] if mode == "delta" else []
            out[name] = {k: _median(sel, k) for k in keys}
            out[name]["n"] = len(sel)
            out[name]["seconds_min_max"] = (
                min(r["seconds"] for r in sel),
                max(r["seconds"] for r in sel),
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shapes", default="tiny,bench,0.5b")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--parts", default="grpo,sync")
    ap.add_argument(
        "--frac", type=float, help="the sync part's changed fraction when no GRPO run measured it"
    )
    ap.add_argument("--work", type=Path, default=None, help="keep models and runs here")
    ap.add_argument(
        "--worker", nargs="+", metavar="ARG", help="MODEL DTYPE FRAC REPEATS OUT [MASTER]"
    )
    ap.add_argument(
        "--master", default="fp32", help="the sync part's actor dtype (bf16: half the memory)"
    )
    ap.add_argument("--render", type=Path, help="print the tables of this report and exit")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    if args.worker:
        model, dtype, frac, repeats, out, *master = args.worker
        sync_worker(model, dtype, float(frac), int(repeats), out, *master)
        return 0
    from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl

    work = args.work or Path(tempfile.mkdtemp(prefix="weight_sync_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    write_jsonl(prompt_rows(512, chat=True), work / "prompts.jsonl")
    (work / "reward.py").write_text(REWARD)
    report = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}
    report["machine_start"] = describe()
    report.setdefault("grpo", {})
    report.setdefault("sync", {})
    for shape in args.shapes.split(","):
        model = build_model(work / f"model_{shape}", shape)
        for dtype in args.dtypes.split(","):
            key = f"{shape} {dtype}"
            if "grpo" in args.parts.split(","):
                save = work / f"grpo_{shape}_{dtype}"
                print(f"grpo {key} ...", flush=True)
                report["grpo"][key] = grpo_run(model, work, save, dtype, args.steps, shape)
                report["grpo"][key]["load_after"] = os.getloadavg()
                _write(args.out, report)
            if "sync" in args.parts.split(","):
                steps = report["grpo"].get(key, {}).get("steps", [])
                fracs = [s.get("rollout/weight_sync_changed_frac") for s in steps]
                fracs = [f for f in fracs if f is not None]
                default = args.frac or (0.02 if dtype == "bf16" else 0.99)
                frac = statistics.median(fracs) if fracs else default
                out = work / f"sync_{shape}_{dtype}.json"
                print(f"sync {key} (changed fraction {frac:.4f}) ...", flush=True)
                worker = [
                    "-m", "scripts.benchkit.weight_sync", "--worker",
                    str(model), dtype, str(frac), str(args.repeats), str(out), args.master,
                ]  # fmt: skip
                load_before = os.getloadavg()
                rc = _torchrun(worker, log=work / f"sync_{shape}_{dtype}.log")
                if rc != 0:
                    report["sync"][key] = {"error": f"exit code {rc}"}
                else:
                    rows = json.loads(out.read_text())
                    report["sync"][key] = {
                        "changed_frac": frac,
                        "actor_dtype": args.master,
                        "summary": summarise_sync(rows),
                        "rows": rows,
                        "load_before": load_before,
                        "load_after": os.getloadavg(),
                    }
                _write(args.out, report)
    report["machine_end"] = describe()
    _write(args.out, report)
    return 0


def render(report: dict) -> str:
    """The report's tables (markdown) from its JSON."""
    out = []
    grpo = {k: v for k, v in report.get("grpo", {}).items() if "steps" in v}
    keys = list(grpo)
    if keys:

        def at(key: str, step: int, metric: str):
            row = next((r for r in grpo[key]["steps"] if r["step"] == step), {})
            return row.get(f"rollout/{metric}")

        out += ["### Share of the engine's elements changed, and of a full sync's bytes sent", ""]
        out += ["| step | " + " | ".join(f"{k}: changed / sent" for k in keys) + " |"]
        out += ["|---" * (len(keys) + 1) + "|"]
        steps = sorted({r["step"] for v in grpo.values() for r in v["steps"]})
        for step in steps:
            cells = []
            for k in keys:
                frac, wire = (
                    at(k, step, "weight_sync_changed_frac"),
                    at(k, step, "weight_sync_wire_bytes"),
                )
                full = at(k, 1, "weight_sync_wire_bytes")
                sent = f"{100 * wire / full:.1f}%" if wire and full else "-"
                cells.append(
                    f"{100 * frac:.2f}% / {sent}" if frac is not None else f"full / {sent}"
                )
            out.append(f"| {step} | " + " | ".join(cells) + " |")
        out += ["", "### Per run (steps 2-20: the delta syncs)", ""]
        out += [
            "| run | engine bytes per sync | sent, median | changed, median (min-max) | "
            "16-element blocks changed | 128-element blocks | sync s, median | making s | "
            "engine waited s | engine vs trainer log-prob, max |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for k in keys:
            rows = [r for r in grpo[k]["steps"] if "rollout/weight_sync_changed_frac" in r]

            def med(metric: str, rows=rows) -> float:
                values = [r[f"rollout/{metric}"] for r in rows if f"rollout/{metric}" in r]
                return statistics.median(values) if values else float("nan")

            fracs = [r["rollout/weight_sync_changed_frac"] for r in rows]
            lp = max(r.get("rollout/logprob_diff/max", 0.0) for r in grpo[k]["steps"])
            out.append(
                f"| {k} | {at(k, 1, 'weight_sync_bytes') / 1e6:.1f} MB | "
                f"{med('weight_sync_wire_bytes') / 1e6:.2f} MB | "
                f"{100 * med('weight_sync_changed_frac'):.2f}% "
                f"({100 * min(fracs):.2f}-{100 * max(fracs):.2f}%) | "
                f"{100 * med('weight_sync_blocks16_frac'):.1f}% | "
                f"{100 * med('weight_sync_blocks128_frac'):.1f}% | "
                f"{med('weight_sync_s'):.3f} | {med('weight_sync_gather_s'):.3f} | "
                f"{med('weight_sync_wait_s'):.3f} | {lp:.2g} |"
            )
    sync = {k: v for k, v in report.get("sync", {}).items() if "summary" in v}
    if sync:
        out += ["", "### Sync wall time, full against delta, with and without overlap", ""]
        out += [
            "| run | mode | wall s, median (min-max) | making s | engine waited s | "
            "engine loading s | sent MB | delta: compare / exchange / apply / checksum s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k, v in sync.items():
            for mode, m in v["summary"].items():
                lo, hi = m["seconds_min_max"]
                parts = "-"
                if "diff_s" in m:
                    parts = " / ".join(
                        f"{m[p]:.3f}" for p in ("diff_s", "exchange_s", "apply_s", "check_s")
                    )
                out.append(
                    f"| {k} ({100 * v['changed_frac']:.2f}% changed) | {mode} | "
                    f"{m['seconds']:.3f} ({lo:.3f}-{hi:.3f}) | {m['gather_s']:.3f} | "
                    f"{m['wait_s']:.3f} | {m['load_s']:.3f} | {m['wire_bytes'] / 1e6:.2f} | "
                    f"{parts} |"
                )
    return "\n".join(out) + "\n"


def _write(path: Path | None, report: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
