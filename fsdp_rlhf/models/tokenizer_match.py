"""Whether a teacher can score the student's token ids: the two tokenizers must map every token
to the same id and have the same special tokens.

Distillation here sends the student's token ids to the teacher, rendered once with the
student's chat template, so only the tokenizers' ids count: the chat templates may differ, and
so may the embedding sizes (two checkpoints of one tokenizer pad their embeddings differently:
Qwen2.5-0.5B/1.5B 151,936 rows, 7B 152,064). Aligning two vocabularies (cross-tokenizer
distillation) is not implemented; a difference is named in one line.
"""

from __future__ import annotations

from typing import Any


def _shown(token: str) -> str:
    return repr(token) if len(token) <= 40 else repr(token[:37] + "...")


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """What differs between two tokenizers' ids and special tokens (None: nothing).

    ``student`` and ``teacher`` are Hugging Face tokenizers; the phrase describes the teacher's
    against the student's (``--pretrain``'s)."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if len(mine) != len(theirs):
        return f"its vocabulary has {len(theirs):,} tokens, --pretrain's {len(mine):,}"
    for token, i in sorted(mine.items(), key=lambda kv: kv[1]):
        j = theirs.get(token)
        if j != i:
            where = "is missing" if j is None else f"is id {j}"
            return f"token {_shown(token)} {where} there (id {i} in --pretrain's)"
    specials = set(student.all_special_tokens), set(teacher.all_special_tokens)
    if specials[0] != specials[1]:
        extra = sorted(specials[1] - specials[0])
        missing = sorted(specials[0] - specials[1])
        parts = []
        if extra:
            parts.append(f"special tokens {', '.join(map(_shown, extra[:3]))} only there")
        if missing:
            parts.append(f"--pretrain's special tokens {', '.join(map(_shown, missing[:3]))} not")
        return "; ".join(parts)
    return None
