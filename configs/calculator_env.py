"""A calculator tool for `fsdp-rlhf ppo --env_file configs/calculator_env.py` (multi-turn).

The model may call the tool by writing ``<calc>3+4*2</calc>``; the environment answers with
``<result>11</result>`` as the next (user) turn and the model goes on. A turn without a tool
call is the final answer: its last integer is compared with the prompt's label (reward 1 when
equal, else 0) and the trajectory ends. Expressions are parsed, never ``eval``-ed: integers,
``+ - *`` and parentheses only. A malformed call gets ``<result>error: ...</result>`` (reward
0, the model may retry); a tool call also earns ``TOOL_CALL_BONUS``, a shaping term.

Prompts: configs/calculator_prompts.jsonl (``--input_key input --label_key label``).
"""

from __future__ import annotations

import re

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
TOKEN = re.compile(r"\s*(\d+|[-+*()])")
TOOL_CALL_BONUS = 0.1
MAX_DIGITS = 30  # a product of huge numbers would stall the trainer


def _tokens(expr: str) -> list[str]:
    pos, out = 0, []
    expr = expr.rstrip()
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"unexpected {expr[pos : pos + 10]!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor ('*' factor)*;
    factor := int | '-' factor | '(' expr ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ValueError("expression ends early")
        self.i += 1
        return tok

    def expr(self) -> int:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> int:
        value = self.factor()
        while self.peek() == "*":
            self.take()
            value *= self.factor()
            if len(str(abs(value))) > MAX_DIGITS:
                raise ValueError("result too large")
        return value

    def factor(self) -> int:
        tok = self.take()
        if tok == "-":
            return -self.factor()
        if tok == "(":
            value = self.expr()
            if self.take() != ")":
                raise ValueError("missing )")
            return value
        if tok.isdigit():
            return int(tok)
        raise ValueError(f"unexpected {tok!r}")


def calculate(expr: str) -> int:
    """The value of an integer ``+ - *`` expression; ValueError when it is not one."""
    parser = _Parser(_tokens(expr))
    value = parser.expr()
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()!r}")
    return value


def final_answer(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def reset(prompt: str, label) -> None:
    return None


def step(history: list[dict], action: str) -> tuple[str | None, float, bool]:
    call = CALL.search(action)
    if call is not None:
        try:
            result = str(calculate(call.group(1)))
        except ValueError as e:
            result = f"error: {e}"
        return f"<result>{result}</result>", TOOL_CALL_BONUS, False
    label = history[0]["label"]
    correct = label is not None and final_answer(action) == int(label)
    return None, float(correct), True
