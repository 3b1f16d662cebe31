"""``bench/results/summary.md``: machine, workload, table, targets, phases, memory, notes."""

from __future__ import annotations

from scripts.benchkit import dynamic_batch, lora, offline, prefix
from scripts.benchkit.notes import matrix_notes, notes
from scripts.benchkit.render import (
    DIFFERS,
    HEADER,
    MATRIX_HEADER,
    SAME,
    matrix_rows,
    md_table,
    phases_md,
    table_rows,
    targets_md,
)


def _machine_md(m: dict, allocator: str) -> str:
    v = ", ".join(f"{k} {val}" for k, val in m["versions"].items())
    gpus = ", ".join(m["gpus"]) or "none"
    load = " / ".join(f"{x:.1f}" for x in m["load_avg_start"])
    end = " / ".join(f"{x:.1f}" for x in m.get("load_avg_end", ()))
    return (
        f"- CPU: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; GPUs: {gpus}\n"
        f"- {m['os']}\n- {v}\n- host allocator: {allocator}\n"
        f"- load average (1/5/15 min) at start: {load}; at end: {end} "
        "(other jobs share these cores: runs are interleaved and medians reported)"
    )


def _workload_md(raw: dict) -> str:
    s = raw["sizes"]
    return (
        f"- Model: Qwen2 architecture, {raw['params_m']:.1f}M parameters (hidden {s['hidden']}, "
        f"{s['layers']} layers, {s['heads']} heads of 64, FFN {s['intermediate']}, "
        f"vocab {s['vocab']}), random init, {s['nproc']} ranks; the Llama-shaped row: "
        f"{raw.get('real_shaped', {}).get('params_m', float('nan')):.1f}M parameters (hidden "
        "576, 9 query / 3 KV heads, FFN 1536, tied embeddings, no head_dim key)\n"
        f"- Precision: the cell's (bf16: bf16 compute, fp32 master weights; fp32: everything "
        f"fp32); the tables above the matrix are the {raw.get('primary_cell', '-')} cell\n"
        f"- RM: {s['rm_pairs_per_step']} pairs/step, micro-batch {s['rm_micro']}/rank, "
        f"{s['rm_steps']} steps ({s['rm_warmup']} warm-up steps not timed), "
        f"{raw['rm_tokens_per_pair']:.0f} tokens per pair on average\n"
        f"- RL: {s['rl_prompts']} prompts x {s['rl_n']} samples/step, up to "
        f"{s['rl_resp_len']} new tokens, micro-batch {s['rl_micro']}/rank, {s['rl_steps']} "
        f"steps ({s['rl_warmup']} warm-up), {s['reps']} interleaved repetitions per comparison"
    )


def _memory_md(raw: dict) -> str:
    rows = []
    for i, run in enumerate(raw["rm_runs"]):
        for side in ("ours", "trl"):
            if side in run:
                rows.append((f"RM {side} rep {i}", f"{run[side]['peak_rss_gib']:.2f}"))
    for i, run in enumerate(raw["rl_runs"]):
        for side in ("ours", "trl"):
            if side in run:
                rows.append((f"GRPO {side} rep {i}", f"{run[side]['peak_rss_gib']:.2f}"))
    for name, run in raw.get("rm_single", {}).items():
        rows.append((f"RM {name}", f"{run['peak_rss_gib']:.2f}"))
    for name, run in raw.get("extra", {}).items():
        rows.append((f"ours {name}", f"{run['peak_rss_gib']:.2f}"))
    per_phase = raw["rl_runs"][0]["ours"]["peak_rss_gib_by_phase"]
    phase_rows = [(k.removesuffix("_gib"), f"{v:.2f}") for k, v in sorted(per_phase.items())]
    return (
        md_table(("run", "peak RSS per process (GiB)"), rows)
        + "\n\nOur PPO processes also hold the vLLM engine (its weights and KV cache, at least "
        "1 GiB on CPU) beside the FSDP2 actor and reference model; TRL's GRPO has no engine."
        + "\n\nOurs, GRPO rep 0, peak RSS of rank 0 at the end of each phase (on CPU this "
        "is the process high-water mark so far, so it only grows):\n\n"
        + md_table(("phase", "GiB"), phase_rows)
    )


def summary_md(raw: dict) -> str:
    parts = [
        f"# Benchmark: fsdp-rlhf vs TRL ({raw['started']})",
        f"`{raw['command']}` took {raw['elapsed_s'] / 60:.1f} min.",
        "## Machine",
        _machine_md(raw["machine"], raw.get("allocator", "glibc malloc")),
        "## Workload",
        _workload_md(raw),
        "## Results",
        md_table(HEADER, table_rows(raw)),
        "Throughput is steady state: time between step log lines after the warm-up steps, "
        "stamped by the bench for both sides. Values are medians over repetitions.",
        "## Targets (issue #8)",
        targets_md(raw),
        "## Matrix: precision x host allocator (issue #15)",
        md_table(MATRIX_HEADER, matrix_rows(raw)),
        "Medians over the interleaved repetitions, [min-max] beside them. MFU: 6 x parameters x "
        "trained tokens/s over the ranks' one-thread matmul peak of the cell's dtype "
        + _peaks(raw)
        + "; ours GRPO: whole step / update phase alone. TRL's GRPO MFU is over its whole step. "
        "Ratio at peak (GRPO): the ratio ours would reach against the same TRL runs if every "
        "matmul of its step ran at that peak and nothing else took time (8 x parameters per "
        "distinct token for the update and reference forward, a group's shared prompt counted "
        "once, and 2 per response token for its decode); a target above it is out of reach here "
        "without less arithmetic or matmuls faster than the probe's.",
        "\n".join(f"- {n}" for n in matrix_notes(raw)),
        *_offline_md(raw),
        *_lora_md(raw),
        *_prefix_md(raw),
        *_dynamic_md(raw),
        "## Phase breakdown of our steps",
        phases_md(raw),
        "## Peak memory",
        _memory_md(raw),
        "## Fairness",
        f"- {SAME}\n- {DIFFERS}",
        "## Where the time goes",
        "\n".join(f"- {n}" for n in notes(raw)),
    ]
    return "\n\n".join(parts) + "\n"


def _peaks(raw: dict) -> str:
    peaks = raw.get("peak_flops_1t", {})
    text = ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items())
    if probes := raw.get("peak_probes"):
        each = [", ".join(f"{k} {v / 1e9:.0f}" for k, v in p.items()) for p in probes]
        text += f"; the faster of the probes at the start ({each[0]}) and end ({each[1]})"
    return f"({text})"


def _offline_md(raw: dict) -> list[str]:
    if not raw.get("offline"):
        return []
    tokens = raw["offline"]["tokens_per_row"]
    return [
        "## SFT and DPO against TRL (issue #31)",
        md_table(*offline.table(raw["offline"])),
        "Medians over interleaved repetitions, [min-max] beside them; the primary cell's "
        "precision and allocator. Ours in the CLI's default configuration (packed micro-batches, "
        "DPO with each pair's prompt once, eager blocks); TRL's SFTTrainer and DPOTrainer with "
        "their defaults (padded micro-batches; DPO with a reference copy), gradient "
        f"checkpointing off on both sides. {tokens['sft']:.0f} tokens per SFT sample and "
        f"{tokens['dpo']:.0f} per DPO pair (both sides, prompt counted twice) on average; "
        "same micro-batch, samples per step and steps as the RM rows.",
    ]


def _lora_md(raw: dict) -> list[str]:
    if not raw.get("lora"):
        return []
    return [
        "## LoRA against full fine-tuning (issue #18)",
        md_table(*lora.table(raw["lora"])),
        "Ours only, the matrix's primary cell, interleaved with its GRPO runs; medians over "
        "the repetitions. Adapters on every linear layer, the reference forward is the base "
        "with the adapters disabled, the sync pushes the adapters only.",
    ]


def _prefix_md(raw: dict) -> list[str]:
    if not raw.get("shared_prefix"):
        return []
    return [
        "## Shared prompt prefix on and off (`--more`)",
        md_table(*prefix.table(raw["shared_prefix"])),
        "Ours only, in the bench process on one thread, fp32, compiled blocks; the same "
        "micro-batch without and with the prefix run once, rounds interleaved.",
    ]


def _dynamic_md(raw: dict) -> list[str]:
    if not raw.get("dynamic_batch"):
        return []
    info = raw["dynamic_batch"]["info"]
    return [
        "## Token-budget micro-batches against fixed ones (`--more`, `--use_dynamic_batch`)",
        md_table(*dynamic_batch.table(raw["dynamic_batch"])),
        f"Ours only, in the bench process on one thread, fp32: one rank's old-log-prob pass and "
        f"actor update (forward + backward) over {info['rows']} rows with responses of varied "
        f"length ({info['real_tokens']} real tokens, padded width {info['width']}); dynamic "
        "micro-batches hold at most as many tokens as a fixed one; rounds interleaved.",
    ]
