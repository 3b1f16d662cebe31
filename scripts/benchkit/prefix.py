"""The shared prompt prefix on and off (``bench.py --more``): one micro-batch's forward and
backward through the bench model, interleaved in this process on one thread, with compiled
blocks as our runs use them.

Whole runs on the 2-core machine move by 10-20% from run to run, more than this change, so the
comparison is made where nothing else varies: the GRPO update's micro-batch (2 prompts x 4
samples, responses of 50-64 of the 64 tokens) and the reference forward, padded against shared,
and the reward model's micro-batch of pairs, packed against packed with each pair's prefix
once.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fsdp_rlhf.data.preference import collate_pairs
from fsdp_rlhf.rollout.engine import pad_token_rows
from scripts.benchkit.rates import interleaved
from scripts.benchkit.workload import Sizes, Workload

# responses end between this fraction of the maximum length and the maximum (the bench's mean
# response was 57 of 64 tokens)
SHORTEST_RESPONSE = 0.78


def _grpo_batch(tokenizer, prompts: list[str], n: int, T: int, seed: int = 0):
    """Left-padded chat prompts, each repeated for its n samples, then random responses
    right-padded to ``T`` tokens."""
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    ids_list = [tokenizer.encode(r, add_special_tokens=False) for r in rendered]
    pad, rng = tokenizer.pad_token_id, random.Random(seed)
    repeated = [p for p in ids_list for _ in range(n)]
    prompt_ids, prompt_mask = pad_token_rows(repeated, pad, left=True)
    shortest = max(1, int(SHORTEST_RESPONSE * T))
    responses = [
        [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(shortest, T))]
        for _ in range(prompt_ids.shape[0])
    ]
    response_ids, response_mask = pad_token_rows(responses, pad, left=False)
    extra = T - response_ids.shape[1]
    ids = torch.cat([prompt_ids, F.pad(response_ids, (0, extra), value=pad)], dim=1)
    return ids, torch.cat([prompt_mask, F.pad(response_mask, (0, extra))], dim=1)


def _pair_batch(tokenizer, rows: list[dict]):
    """B pairs as ``train-rm`` lays them out: chosen rows, then rejected rows, EOS-terminated."""
    ids = {f"{side}_ids": [tokenizer.encode(r[side]) + [tokenizer.eos_token_id] for r in rows]
           for side in ("chosen", "rejected")}  # fmt: skip
    batch = collate_pairs(ids, tokenizer.pad_token_id)
    return batch.input_ids, batch.attention_mask


def cases(w: Workload, s: Sizes, compile: bool = True) -> dict[str, Callable[[], None]]:
    """Name -> one timed call; each pair of names is the same work without and with sharing."""
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.attention import use_varlen_attention
    from fsdp_rlhf.models.compile import compile_blocks
    from fsdp_rlhf.models.forward import response_logprobs, sequence_scores
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model, load_tokenizer

    tok = load_tokenizer(str(w.model))
    prompts = [json.loads(line)["input"] for line in open(w.prompts)]
    groups = s.rl_micro // s.rl_n
    ids, mask = _grpo_batch(tok, prompts[:groups], s.rl_n, s.rl_resp_len)
    actor = load_causal_lm(str(w.model), BackendConfig(), "cpu")
    pairs = [json.loads(line) for line in open(w.pairs)][: s.rm_micro]
    pair_ids, pair_mask = _pair_batch(tok, pairs)
    rm = load_scalar_model(str(w.model), BackendConfig(), "cpu", value_head_prefix="score")
    rm.config.pad_token_id = tok.pad_token_id
    use_varlen_attention(rm)
    if compile:
        compile_blocks(actor)
        compile_blocks(rm)

    def update(group: int) -> None:
        lp, _ = response_logprobs(
            actor,
            forward_inputs(ids, mask, group_size=group, response_len=s.rl_resp_len),
            s.rl_resp_len,
        )
        lp.sum().backward()
        actor.zero_grad(set_to_none=True)

    @torch.no_grad()
    def reference(group: int) -> None:
        response_logprobs(
            actor,
            forward_inputs(ids, mask, group_size=group, response_len=s.rl_resp_len),
            s.rl_resp_len,
        )

    def reward(shared: bool) -> None:
        inputs = forward_inputs(pair_ids, pair_mask, packed=not shared, pairs=shared)
        scores = sequence_scores(rm, inputs)
        scores.sum().backward()
        rm.zero_grad(set_to_none=True)

    return {
        "GRPO update micro-batch, forward + backward": lambda: update(1),
        "GRPO update micro-batch, forward + backward, shared": lambda: update(s.rl_n),
        "GRPO reference forward": lambda: reference(1),
        "GRPO reference forward, shared": lambda: reference(s.rl_n),
        "RM micro-batch, forward + backward (packed)": lambda: reward(False),
        "RM micro-batch, forward + backward (packed), shared": lambda: reward(True),
    }


def measure(w: Workload, s: Sizes, reps: int = 9, warmup: int = 3, compile: bool = True) -> dict:
    """Median seconds of each case over ``reps`` interleaved rounds, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cases are built on one thread too
    try:
        calls = cases(w, s, compile)
    finally:
        torch.set_num_threads(threads)
    times = interleaved(calls, reps, warmup)  # the warm-up compiles and settles both layouts
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
            for name, t in times.items()}  # fmt: skip


def table(result: dict) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Rows of (work, off ms, on ms, on / off) from :func:`measure`."""
    rows = []
    names = list(result)
    for off, on in zip(names[0::2], names[1::2], strict=True):
        a, b = result[off]["median_s"], result[on]["median_s"]
        rows.append((off, f"{1e3 * a:.0f}", f"{1e3 * b:.0f}", f"{b / a:.2f}x"))
    header = ("one micro-batch, median of interleaved rounds", "ms", "ms shared", "shared / not")
    return header, rows
