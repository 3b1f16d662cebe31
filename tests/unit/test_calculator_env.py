"""The worked example configs/calculator_env.py: safe arithmetic and the tool/answer turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_rlhf.rollout.env import import_user_file, load_environment

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def calc():
    return import_user_file(str(CONFIGS / "calculator_env.py"), "--env_file")


@pytest.mark.parametrize(
    "expr,value", [("3+4", 7), ("2 + 3 * 4", 14), ("(2+3)*4", 20), ("-5 - -2", -3), ("7", 7)]
)
def test_calculate(calc, expr, value):
    assert calc.calculate(expr) == value


@pytest.mark.parametrize(
    "expr", ["__import__('os')", "2**8", "1/0", "3 +", "(1+2", "1 2", "9" * 20 + "*" + "9" * 20]
)
def test_calculate_refuses_anything_else(calc, expr):
    with pytest.raises(ValueError):
        calc.calculate(expr)


def test_tool_turn_then_graded_answer(calc):
    history = [{"role": "user", "content": "Compute 3+4.", "label": "7"}]
    obs, reward, done = calc.step(history, "let me see <calc>3+4</calc>")
    assert (obs, reward, done) == ("<result>7</result>", calc.TOOL_CALL_BONUS, False)
    assert calc.step(history, "<calc>3+</calc>")[0].startswith("<result>error:")
    assert calc.step(history, "the answer is 7") == (None, 1.0, True)
    assert calc.step(history, "the answer is 8") == (None, 0.0, True)
    assert calc.step(history, "no idea") == (None, 0.0, True)


def test_shipped_prompts_match_labels(calc):
    rows = [json.loads(x) for x in (CONFIGS / "calculator_prompts.jsonl").read_text().splitlines()]
    assert len(rows) >= 32
    for row in rows:
        expr = row["input"].removeprefix("Compute ").split(".")[0]
        assert calc.calculate(expr) == int(row["label"]), row
    assert load_environment(str(CONFIGS / "calculator_env.py"), 1.0).path.endswith(".py")
