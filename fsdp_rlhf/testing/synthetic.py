"""Synthetic preference and prompt sets for the demo, the benchmark and the tests.

The preference signal is simple enough for a tiny reward model to learn in a minute: chosen
replies use words from ``POSITIVE``, rejected ones from ``NEGATIVE``. A policy optimised against
that reward model should drift towards positive words.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from fsdp_rlhf.testing.tiny import WORDS

POSITIVE = "good happy kind helpful honest thanks yes please".split()
NEGATIVE = "bad sad hates sorry no harmless why far".split()
NEUTRAL = [w for w in WORDS if w not in POSITIVE and w not in NEGATIVE]


def _sentence(rng: random.Random, pool: list[str], n_min: int, n_max: int) -> str:
    return " ".join(rng.choice(pool) for _ in range(rng.randint(n_min, n_max)))


def _reply(rng: random.Random, flavour: list[str]) -> str:
    # Mostly neutral words with a few flavoured ones: the RM must find the signal.
    words = [
        rng.choice(flavour) if rng.random() < 0.5 else rng.choice(NEUTRAL)
        for _ in range(rng.randint(3, 8))
    ]
    return " ".join(words)


def preference_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """hh-rlhf-shaped pairs: full texts under ``chosen``/``rejected`` plus a ``prompt``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = f"Human: {_sentence(rng, NEUTRAL, 3, 8)}\nAssistant: "
        chosen, rejected = _reply(rng, POSITIVE), _reply(rng, NEGATIVE)
        rows.append(
            {
                "prompt": prompt,
                "chosen": prompt + chosen,
                "rejected": prompt + rejected,
                "chosen_reply": chosen,
                "rejected_reply": rejected,
            }
        )
    return rows


def prompt_rows(n: int, seed: int = 0, chat: bool = False) -> list[dict]:
    """Prompts under ``input`` (text) or ``context_messages`` (chat list when ``chat``)."""
    rng = random.Random(seed + 1)
    rows = []
    for _ in range(n):
        text = _sentence(rng, NEUTRAL, 3, 8)
        row = {"input": text, "label": "positive"}
        if chat:
            row["context_messages"] = [{"role": "user", "content": text}]
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


POSITIVE_REWARD_PY = '''"""Rule reward: the fraction of response words that are positive."""
POSITIVE = set({positive!r})


def reward_func(queries, prompts, labels):
    out = []
    for query, prompt in zip(queries, prompts):
        words = query[len(prompt):].split()
        out.append(sum(w in POSITIVE for w in words) / max(len(words), 1))
    return out
'''

SHORT_REWARD_PY = '''"""Rule reward: shorter responses score higher (1 - characters / 100, >= 0)."""


def reward_func(queries, prompts, labels):
    return [max(0.0, 1.0 - len(q[len(p):]) / 100.0) for q, p in zip(queries, prompts)]
'''


def write_reward_file(path: str | Path, kind: str = "positive") -> Path:
    """A ``--remote_rm_url`` Python file: ``positive`` words or ``short`` responses."""
    body = POSITIVE_REWARD_PY.format(positive=POSITIVE) if kind == "positive" else SHORT_REWARD_PY
    path = Path(path)
    path.write_text(body)
    return path


# A fixed word -> word map: the continuation task `sft` tests and the demo learn.
CONTINUATION_MAP = dict(
    zip(
        "cat dog bird fish tree sun moon star".split(),
        "red blue green big small one two three".split(),
        strict=True,
    )
)


def continuation_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``input``: a few words; ``output``: the word ``CONTINUATION_MAP`` gives the last one.
    A model has to learn the map and where to look; random weights get it right by chance."""
    rng = random.Random(seed)
    keys = list(CONTINUATION_MAP)
    rows = []
    for _ in range(n):
        words = [rng.choice(keys) for _ in range(rng.randint(2, 5))]
        rows.append({"input": " ".join(words), "output": CONTINUATION_MAP[words[-1]]})
    return rows
