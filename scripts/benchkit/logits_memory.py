"""Peak host memory of one micro-batch's log-prob forward at a real vocabulary size (issue #30).

A policy forward's logits are (B, T, V) with V = 151,936 for Qwen2: every full-size copy of them
(an fp32 upcast, a ``/ temperature``, a reshape of a sliced view) costs as much as the rest of a
small model's activations together. This measures, on CPU, what one micro-batch of
``models.forward.response_logprobs`` adds to the process's peak resident memory:

- ``no_grad``: the old-log-prob / reference forward (``trainers.experience.batched_logprobs``);
- ``update``: the actor update's forward and backward (log-probs with grad, entropy as a metric).

Each case runs in a fresh process; the peak is Linux's VmHWM after resetting it through
``/proc/self/clear_refs`` (tracemalloc does not see torch's allocations), minus the resident
memory before the call. glibc's mmap threshold is pinned at 1 MiB so that every large tensor is
mapped on allocation and unmapped when freed: the high-water mark is then the peak of live
tensors, not of what the heap kept (its default threshold adapts and keeps freed 32 MiB blocks).
``--repo`` measures another checkout (e.g. the code before a change) with the same script.
The model is a tiny Qwen2 built in memory (config without ``head_dim``, 151,936-token
vocabulary, random weights): its logits dwarf its activations, as at scale.

    python -m scripts.benchkit.logits_memory                # all cases, prints a table and JSON
    python -m scripts.benchkit.logits_memory --case update --dtype bf16   # one case, one line
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VOCAB = 151_936
MiB = 1 << 20


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def measure(
    case: str, dtype_name: str, batch: int, prompt: int, response: int, repo: Path = REPO
) -> dict:
    """One micro-batch in this process; returns the peak added over the resident baseline."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(repo))
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs

    torch.manual_seed(0)
    torch.set_num_threads(2)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model.config._attn_implementation = "sdpa"
    L = prompt + response
    ids = torch.randint(0, VOCAB, (batch, L))
    mask = torch.ones_like(ids)
    for i in range(batch):  # left-padded prompts of different lengths
        mask[i, : 8 * i] = 0
    # warm-up on a small batch: one-time allocations (kernels, thread pools) are not counted
    response_logprobs(model, forward_inputs(ids[:1, -40:], mask[:1, -40:]), 8, with_entropy=True)
    base = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    if case == "no_grad":
        with torch.no_grad():
            lp, _ = response_logprobs(model, forward_inputs(ids, mask), response)
    else:
        lp, ent = response_logprobs(
            model, forward_inputs(ids, mask), response, with_entropy=True, entropy_grad=False
        )
        loss = -lp.mean()
        loss.backward()
    peak = _status_kib("VmHWM")
    full_fp32 = batch * response * VOCAB * 4
    return {
        "case": case,
        "dtype": dtype_name,
        "batch": batch,
        "prompt": prompt,
        "response": response,
        "vocab": VOCAB,
        "peak_added_mib": round((peak - base) / 1024, 1),
        "fp32_logits_copy_mib": round(full_fp32 / MiB, 1),
        "logprob_sum": float(lp.detach().double().sum()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=("no_grad", "update"))
    p.add_argument("--dtype", choices=("fp32", "bf16"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=448)
    p.add_argument("--repo", type=Path, default=REPO, help="checkout whose fsdp_rlhf to measure")
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args()
    if a.case and a.dtype:
        row = measure(a.case, a.dtype, a.batch, a.prompt, a.response, a.repo.resolve())
        print(json.dumps(row), flush=True)
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "LD_PRELOAD": ""}
    rows = []
    for dtype in ("fp32", "bf16"):
        for case in ("no_grad", "update"):
            cmd = [sys.executable, __file__, "--case", case, "--dtype", dtype]
            cmd += ["--batch", str(a.batch), "--prompt", str(a.prompt)]
            cmd += ["--response", str(a.response), "--repo", str(a.repo)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(
                f"{r['dtype']:5} {r['case']:8} B={r['batch']} P={r['prompt']} T={r['response']} "
                f"V={r['vocab']}: peak +{r['peak_added_mib']:.0f} MiB "
                f"(one fp32 (B,T,V) copy = {r['fp32_logits_copy_mib']:.0f} MiB)",
                flush=True,
            )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
