"""Token-budget micro-batches (``--use_dynamic_batch``) against fixed-size ones, on responses of
varied length (``bench.py --more``, or on its own: ``python -m scripts.benchkit.dynamic_batch``).

The work is one rank's training-side forwards of a PPO step, through the trainer's own code
(``trainers.experience.micro_batches`` and ``batched_logprobs``): the no-grad old-log-prob pass
and the actor update's forward and backward, over the same rows, on the bench model, in this
process on one thread, interleaved (fixed, dynamic, fixed, dynamic...), medians.

Fixed: ``micro`` rows per micro-batch, each padded to the batch's width (prompt_max_len +
generate_max_len as the rollout pads them). Dynamic: the rows sorted and bin-packed into
micro-batches of at most ``micro x width`` tokens (rows x longest), the same peak size as a
fixed micro-batch, each cut to its own longest row. Reported: median seconds per step, the
tokens the forwards compute (padding included) and the real ones, micro-batches per pass.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts.benchkit.rates import interleaved
from scripts.benchkit.workload import FULL, SMOKE, Sizes, Workload, build_workload

REPO = Path(__file__).resolve().parents[2]


def varied_batch(tokenizer, prompts: list[str], rows: int, max_response: int, seed: int = 0):
    """``rows`` chat prompts (left-padded) with random responses of 8..max_response tokens,
    right-padded to max_response, as a rollout returns them. Returns ids, mask, response mask."""
    from fsdp_rlhf.rollout.engine import pad_token_rows

    rng = random.Random(seed)
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompts[i % len(prompts)]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(rows)
    ]
    prompt_ids, prompt_mask = pad_token_rows(
        [tokenizer.encode(r, add_special_tokens=False) for r in rendered],
        tokenizer.pad_token_id,
        left=True,
    )
    responses = [
        [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(8, max_response))]
        for _ in range(rows)
    ]
    response_ids, response_mask = pad_token_rows(responses, tokenizer.pad_token_id, left=False)
    extra = max_response - response_ids.shape[1]
    response_ids = F.pad(response_ids, (0, extra), value=tokenizer.pad_token_id)
    response_mask = F.pad(response_mask, (0, extra))
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    return ids, torch.cat([prompt_mask, response_mask], dim=1), response_mask.float()


def cases(w: Workload, s: Sizes, rows: int, max_response: int) -> tuple[dict, dict]:
    """The two calls (fixed, dynamic) and what each computes."""
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import InputSpec, forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer
    from fsdp_rlhf.trainers.experience import Experience, batched_logprobs, micro_batches
    from fsdp_rlhf.trainers.micro_batches import MicroBatching, padded_tokens

    tok = load_tokenizer(str(w.model), False)
    prompts = [json.loads(line)["input"] for line in open(w.prompts)]
    ids, mask, rmask = varied_batch(tok, prompts, rows, max_response)
    exp = Experience(ids, mask, rmask, engine_logprobs=torch.zeros_like(rmask))
    actor = load_causal_lm(str(w.model), BackendConfig(), "cpu")
    width = ids.shape[1]
    fixed = MicroBatching(s.rl_micro)
    dynamic = MicroBatching(s.rl_micro, max_tokens=s.rl_micro * width)
    tokens = float(rmask.sum())

    def step(batching: MicroBatching) -> None:
        batched_logprobs(actor, exp, batching, 1.0, InputSpec())  # old log-probs (no grad)
        for _rows, mb in micro_batches(exp, batching):  # the update's forward + backward
            lp, _ = response_logprobs(
                actor, forward_inputs(mb.input_ids, mb.attention_mask), mb.response_len
            )
            ((lp * mb.response_mask).sum() / tokens).backward()
        actor.zero_grad(set_to_none=True)

    lengths = exp.lengths
    info = {}
    for name, batching, w_ in (("fixed", fixed, width), ("dynamic", dynamic, None)):
        micros = batching.split(lengths)
        info[name] = {
            "micro_batches": len(micros),
            "tokens_computed": padded_tokens(lengths, micros, w_),
        }
    info["real_tokens"] = int(lengths.sum())
    info["rows"], info["width"] = rows, width
    return {"fixed": lambda: step(fixed), "dynamic": lambda: step(dynamic)}, info


def measure(
    w: Workload, s: Sizes, rows: int = 32, max_response: int = 256, reps: int = 7, warmup: int = 2
) -> dict:
    """Median seconds per step of each case over ``reps`` interleaved rounds, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cases are built on one thread too
    try:
        calls, info = cases(w, s, rows, max_response)
    finally:
        torch.set_num_threads(threads)
    times = interleaved(calls, reps, warmup)
    out = {"info": info, "reps": reps}
    for name, t in times.items():
        out[name] = {
            "median_s": statistics.median(t),
            "min_s": min(t),
            "max_s": max(t),
            **info[name],
        }
    return out


def table(result: dict) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    info = result["info"]
    header = ("micro-batches", "s per step (median)", "tokens computed", "count", "vs fixed")
    base = result["fixed"]["median_s"]
    rows = []
    for name in ("fixed", "dynamic"):
        r = result[name]
        rows.append(
            (
                name,
                f"{r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f})",
                f"{r['tokens_computed']} ({r['tokens_computed'] / info['real_tokens']:.2f}x real)",
                str(r["micro_batches"]),
                f"{r['median_s'] / base:.2f}x",
            )
        )
    return header, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    p.add_argument("--rows", type=int, default=32, help="rows of the step on this rank")
    p.add_argument("--max_response", type=int, default=256)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    s = SMOKE if a.smoke else FULL
    with tempfile.TemporaryDirectory(prefix="bench_dynamic_") as work:
        w = build_workload(Path(work) / "data", s)
        reps = 1 if a.smoke else 7
        result = measure(w, s, a.rows, a.max_response, reps=reps, warmup=1 if a.smoke else 2)
    result["params_m"] = w.params_m
    header, rows = table(result)
    info = result["info"]
    print(
        f"{info['rows']} rows, responses 8-{a.max_response} tokens, width {info['width']}, "
        f"{info['real_tokens']} real tokens; {w.params_m:.1f}M-parameter model, 1 thread, "
        f"{result['reps']} interleaved rounds"
    )
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(r))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
