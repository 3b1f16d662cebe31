"""Rule-reward decoding and checks, the bad-step guard and the KL controller's NaN handling."""

from __future__ import annotations

import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from fsdp_rlhf.algorithms.kl import AdaptiveKLController
from fsdp_rlhf.errors import Fault, UserError
from fsdp_rlhf.trainers.guards import (
    BadStepGuard,
    NonFiniteError,
    check_finite_scores,
    finite_mean,
    guarded_step,
)
from fsdp_rlhf.trainers.rule_reward import (
    build_rule_reward,
    decode_responses,
    http_reward,
    redact_url,
)


def bang_tokenizer():
    """A word-level tokenizer whose id 0 is the ordinary token "!" (as in Qwen2/GPT-2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"!": 0, "yes": 1, "no": 2, "maybe": 3, "<pad>": 4, "<eos>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def test_decode_responses_skips_padding_even_when_id_0_is_a_token():
    tok = bang_tokenizer()
    assert tok.convert_ids_to_tokens([0]) == ["!"]
    ids = torch.tensor([[1, 2, 3, 4], [2, 4, 4, 4], [1, 0, 5, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    # The old way: masked ids become 0, i.e. "!", appended to every short response.
    old = tok.batch_decode((ids * mask).tolist(), skip_special_tokens=True)
    assert old[1].startswith("no") and old[1].count("!") == 3
    out = decode_responses(tok, ids, mask)
    assert out[1] == "no"
    assert out == [tok.decode(r, skip_special_tokens=True) for r in ([1, 2, 3], [2], [1, 0, 5])]
    assert out[2].count("!") == 1  # a real "!" in the response survives


def test_guard_skips_then_aborts_after_max_bad_steps():
    guard = BadStepGuard(max_bad_steps=2, name="actor")
    assert guard.check(1.5, step=1)
    assert not guard.check(float("nan"), step=2)
    assert not guard.check(torch.tensor(float("inf")), step=3)
    assert guard.check(0.3, step=4)  # a finite step resets the run of bad ones
    assert not guard.check(float("nan"), step=5)
    assert not guard.check(float("nan"), step=6)
    with pytest.raises(NonFiniteError, match=r"actor: gradient norm is nan at step 7.*3 non"):
        guard.check(float("nan"), step=7)
    assert guard.metrics("actor/") == {"actor/skipped_steps": 5.0}
    restored = BadStepGuard(2)
    restored.load_state_dict(guard.state_dict())
    assert restored.skipped == 5


def test_guard_zero_aborts_at_first_bad_step():
    with pytest.raises(UserError, match="--max_bad_steps 0"):
        BadStepGuard(0).check(float("inf"), step=1)


def test_check_finite_scores_names_source_and_step():
    assert check_finite_scores(torch.tensor([1.0, -2.0]), 3, "reward model").tolist() == [1, -2]
    with pytest.raises(NonFiniteError, match=r"reward model returned 1 .* at step 9 .*index 1"):
        check_finite_scores(torch.tensor([0.0, float("nan"), 2.0]), 9, "reward model")


def test_adaptive_kl_ignores_non_finite_kl():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    for bad in (float("nan"), float("inf"), -float("inf")):
        ctl.update(bad, 10)
        assert ctl.value == 0.1
    ctl.update(2.0, 10)
    assert math.isclose(ctl.value, 0.1 * (1 + 0.2 * 10 / 100))


def test_python_rule_reward_rejects_nan(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def reward_func(queries, prompts, labels):\n    return [1.0, float('nan')]\n")
    fn = build_rule_reward(str(f))
    with pytest.raises(NonFiniteError, match=f"rule reward file {f}"):
        fn(["a", "b"], ["", ""], [None, None])


class _Server(BaseHTTPRequestHandler):
    seen_auth: list[str | None] = []
    reply = b'{"rewards": [1.0, NaN]}'  # Python's json accepts NaN; so do many servers

    def do_POST(self):  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers["Content-Length"]))
        _Server.seen_auth.append(self.headers.get("Authorization"))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.reply)))
        self.end_headers()
        self.wfile.write(self.reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = HTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Server.seen_auth = []
    yield srv
    srv.shutdown()


def test_http_rule_reward_rejects_nan_without_retrying(server, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "s3cret")
    url = f"http://127.0.0.1:{server.server_port}/score?key=abc"
    fn = http_reward(url, auth_env="RM_TOKEN")
    with pytest.raises(NonFiniteError, match=r"HTTP reward endpoint .*key=\*\*\*") as err:
        fn(["a", "b"], ["", ""], [None, None])
    assert "abc" not in str(err.value)
    assert _Server.seen_auth == ["Bearer s3cret"]  # sent once: a NaN is not retried


def test_http_rule_reward_logs_a_redacted_url(monkeypatch, caplog):
    monkeypatch.setattr("fsdp_rlhf.trainers.rule_reward.time.sleep", lambda s: None)
    fn = http_reward("http://user:pw@127.0.0.1:9/r?token=t0k", retries=1, timeout_s=0.5)
    with caplog.at_level(logging.WARNING), pytest.raises(Fault) as err:
        fn(["q"], ["p"], [None])
    text = caplog.text + str(err.value)
    assert "pw" not in text and "t0k" not in text and "user" not in text
    assert "***@127.0.0.1:9/r?token=***" in text


def test_auth_env_must_be_set(monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    with pytest.raises(UserError, match="NO_SUCH_TOKEN_VAR"):
        http_reward("http://127.0.0.1:9/", auth_env="NO_SUCH_TOKEN_VAR")
    with pytest.raises(UserError, match="only to an http"):
        build_rule_reward("r.py", auth_env="X")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://rm.example/v1", "https://rm.example/v1"),
        (
            "https://u:p@rm.example:8443/v1?api_key=k&x=1",
            "https://***@rm.example:8443/v1?api_key=***&x=***",
        ),
        ("/data/reward.py", "/data/reward.py"),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    assert json.dumps(shown)  # plain text


def _linear_with_grads(value: float):
    layer = torch.nn.Linear(3, 2)
    layer.weight.grad = torch.full_like(layer.weight, value)
    layer.bias.grad = torch.ones_like(layer.bias)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    return layer, opt, sched


def test_guarded_step_skips_the_update_but_advances_the_schedule():
    layer, opt, sched = _linear_with_grads(float("nan"))
    before = layer.weight.detach().clone()
    guard = BadStepGuard(1, "actor")
    norm = guarded_step(layer.parameters(), opt, sched, 1.0, guard, step=7)
    assert math.isnan(norm) and guard.skipped == 1
    assert torch.equal(layer.weight, before)  # no NaN written into the weights
    assert layer.weight.grad is None  # and no NaN left to leak into the next step
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.05
    layer.weight.grad = torch.full_like(layer.weight, float("inf"))
    with pytest.raises(NonFiniteError, match="actor: gradient norm is inf at step 8"):
        guarded_step(layer.parameters(), opt, sched, 1.0, guard, step=8)


def test_guarded_step_takes_a_finite_step_clipped():
    layer, opt, sched = _linear_with_grads(2.0)
    before = layer.weight.detach().clone()
    guard = BadStepGuard(0, "critic")
    norm = guarded_step(layer.parameters(), opt, sched, 1.0, guard, step=1)
    assert norm == pytest.approx(math.sqrt(6 * 4.0 + 2 * 1.0))
    # clipped to norm 1, then one SGD step at lr 0.1
    expected = before - 0.1 * 2.0 / norm
    assert torch.allclose(layer.weight, expected, atol=1e-6)
    assert guard.skipped == 0 and guard.metrics("critic/") == {"critic/skipped_steps": 0.0}


def test_finite_mean_ignores_skipped_steps():
    assert finite_mean([1.0, float("nan"), 3.0]) == 2.0
    assert math.isnan(finite_mean([float("inf")]))
