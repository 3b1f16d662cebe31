"""Each chat template we ship is append-only for the turns a multi-turn rollout builds: the
token stream we assemble (prompt, model turns as generated, observations tokenised on their
own) equals the template's rendering of the whole conversation, tokenised at once."""

from __future__ import annotations

import pytest

from fsdp_rlhf.rollout.multiturn import OBSERVATION_ROLE, ObservationTokens
from fsdp_rlhf.testing.tiny import CHAT_TEMPLATE, build_tokenizer

SHIPPED_TEMPLATES = {"tiny": CHAT_TEMPLATE}

CONVERSATION = [
    ("user", "what is three plus four?"),
    ("assistant", "<calc>3+4</calc>"),
    (OBSERVATION_ROLE, "<result>7</result>"),
    ("assistant", "the answer is 7"),
    (OBSERVATION_ROLE, ""),
    ("assistant", "seven"),
]


@pytest.fixture(scope="module")
def base_tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def render(tok, messages, gen: bool) -> str:
    msgs = [{"role": r, "content": c} for r, c in messages]
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


@pytest.mark.parametrize("name", sorted(SHIPPED_TEMPLATES))
def test_rendering_is_append_only(base_tok, name):
    base_tok.chat_template = SHIPPED_TEMPLATES[name]
    previous = ""
    for k in range(1, len(CONVERSATION) + 1):
        gen = CONVERSATION[k - 1][0] != "assistant"
        text = render(base_tok, CONVERSATION[:k], gen)
        assert text.startswith(previous), f"turn {k} rewrites earlier turns"
        previous = text


@pytest.mark.parametrize("name", sorted(SHIPPED_TEMPLATES))
def test_appended_stream_equals_full_rendering(base_tok, name):
    tok = base_tok
    tok.chat_template = SHIPPED_TEMPLATES[name]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    observations = ObservationTokens(tok)
    stream = tok(render(tok, CONVERSATION[:1], True), add_special_tokens=False)["input_ids"]
    for role, content in CONVERSATION[1:]:
        if role == "assistant":  # as the engine returns it: the text, then end of turn
            stream += tok(content, add_special_tokens=False)["input_ids"] + [end]
        else:
            stream += observations.ids(content, tok.decode([end]))
    full = tok(render(tok, CONVERSATION, False), add_special_tokens=False)["input_ids"]
    assert full[: len(stream)] == stream
    # the template closes the last turn with a separator the model never generates
    assert tok.decode(full[len(stream) :]).strip() == ""
