"""Synthetic preference data a tiny reward model can learn, and RM config helpers for tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from fsdp_rlhf.testing.tiny import WORDS

FILLER = [w for w in WORDS if w not in ("good", "bad")]


def synthetic_pairs(n: int, seed: int) -> list[dict[str, str]]:
    """hh-rlhf shaped pairs: the chosen reply says "good", the rejected one "bad".

    Prompt and filler words are shared, so the only signal is the good/bad word.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = " ".join(rng.choice(FILLER) for _ in range(rng.randint(3, 8)))
        filler = " ".join(rng.choice(FILLER) for _ in range(rng.randint(1, 4)))
        k = rng.randint(1, 3)
        rows.append(
            {
                "chosen": f"Human: {prompt}\nAssistant: {filler} " + " ".join(["good"] * k),
                "rejected": f"Human: {prompt}\nAssistant: {filler} " + " ".join(["bad"] * k),
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
