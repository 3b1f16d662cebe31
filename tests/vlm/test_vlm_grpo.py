"""GRPO on a tiny Qwen2.5-VL (random weights, the real processor) must learn to name the colour
of a solid-colour image: the reward rises only if the pixels reach both vLLM (which samples the
answers) and the update (which must tie the answer to the image).

The control is the same run on images that carry no information (every image the same grey,
the labels unchanged): a policy can then do no better than always naming one colour, a third
of the rewards. The vocabulary is word-level (``testing.tiny_vlm``), so a random policy names
the right colour first with probability about 1/15 and GRPO has a signal from the first step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import read_metrics, torchrun

pytestmark = [pytest.mark.vlm, pytest.mark.slow]

STEPS = 40


def grpo_flags(model: str, data: Path, prompts: str, save: Path, extra=()) -> list[str]:
    return [
        "--pretrain", model,
        "--remote_rm_url", str(data / "reward.py"),
        "--prompt_data", str(data / prompts),
        "--input_key", "prompt",
        "--label_key", "label",
        "--image_key", "images",
        "--apply_chat_template",
        "--advantage_estimator", "grpo",
        "--rollout_batch_size", "16",
        "--n_samples_per_prompt", "8",
        "--train_batch_size", "128",
        "--micro_train_batch_size", "32",
        "--micro_rollout_batch_size", "32",
        "--generate_max_len", "2",
        "--prompt_max_len", "24",
        "--max_steps", str(STEPS),
        "--num_episodes", "7",  # 96 prompts / 16 per step: 6 steps an episode
        "--actor_learning_rate", "3e-3",
        "--lr_warmup_ratio", "0",
        "--init_kl_coef", "0",
        "--save_path", str(save),
        "--save_steps", "-1",
        "--seed", "1",
        "--vllm_kvcache_space_gib", "0.25",
        *extra,
    ]  # fmt: skip


def _scores(save: Path) -> list[float]:
    return [r["critic/score/mean"] for r in read_metrics(save)]


def test_grpo_learns_the_colour_and_blank_images_do_not(colour_vl, colour_data, tmp_path):
    runs = {}
    for name, prompts in (("images", "prompts.jsonl"), ("blank", "blank.jsonl")):
        save = tmp_path / name
        proc = torchrun(["ppo", *grpo_flags(colour_vl, colour_data, prompts, save)], timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = _scores(save)
        # every step syncs the weights, then samples: engine (fp32) and trainer agree
        diffs = [r["rollout/logprob_diff/max"] for r in read_metrics(save)]
        assert len(diffs) == STEPS and max(diffs) < 1e-3, diffs
    first, last = (sum(s[:5]) / 5 for s in runs.values()), (sum(s[-5:]) / 5 for s in runs.values())
    print(json.dumps(runs))
    (img_first, _), (img_last, blank_last) = first, last
    assert img_last > 0.8, runs["images"]
    assert blank_last < 0.5, runs["blank"]  # a third at best, whatever the policy learns
    assert img_last - img_first > 0.4


def test_an_unreadable_image_or_a_404_is_one_line_naming_the_row(colour_vl, colour_data, tmp_path):
    """Random bytes saved as .png in row 3, or row 2's image URL answering 404: one line
    naming --prompt_data, the row and the image, before any model loads."""
    import functools
    import http.server
    import threading

    from tests.e2e.helpers import run_cli

    rows = [json.loads(line) for line in (colour_data / "prompts.jsonl").read_text().splitlines()]
    junk = tmp_path / "junk.png"
    junk.write_bytes(bytes(range(256)) * 4)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/gone.png"
    cases = {
        "junk.jsonl": (2, str(junk), f"image file '{junk}' is not an image PIL can read"),
        "gone.jsonl": (1, url, f"image URL {url}: the server answered 404"),
    }
    try:
        for name, (index, ref, message) in cases.items():
            bad = [dict(r) for r in rows[:8]]
            bad[index]["images"] = [ref]
            (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in bad))
            flags = grpo_flags(colour_vl, colour_data, "prompts.jsonl", tmp_path / "out")
            flags[flags.index("--prompt_data") + 1] = str(tmp_path / name)
            proc = run_cli(["ppo", *flags], env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
            assert proc.returncode == 2, proc.stderr[-3000:]
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
            assert f"--prompt_data {tmp_path / name}: row {index + 1}: {message}" in lines[0]
            assert not (tmp_path / "out").exists()
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    "name, flags",
    [
        # each alone in make test-long; CI runs both together (sp2_packed)
        pytest.param("packed", ["--packing_samples"], marks=pytest.mark.long),
        pytest.param("sp2", ["--sequence_parallel_size", "2"], marks=pytest.mark.long),
        ("sp2_packed", ["--sequence_parallel_size", "2", "--packing_samples"]),
    ],
)
def test_grpo_packed_or_split_agrees_with_the_engine(colour_vl, colour_data, tmp_path, name, flags):
    """--packing_samples (each packed sequence its own images and M-RoPE positions) and
    --sequence_parallel_size 2 (the images merged into whole rows, the language model on each
    rank's slice) on images: the trainer's log-probs of the sampled answers are the engine's
    (fp32) after every sync."""
    save = tmp_path / name
    steps = 3
    extra = [*flags, "--max_steps", str(steps), "--rollout_batch_size", "8",
             "--n_samples_per_prompt", "4", "--train_batch_size", "32",
             "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8"]  # fmt: skip
    proc = torchrun(["ppo", *grpo_flags(colour_vl, colour_data, "prompts.jsonl", save, extra)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    diffs = [r["rollout/logprob_diff/max"] for r in read_metrics(save)]
    print(name, "rollout/logprob_diff/max", diffs)
    assert len(diffs) == steps and max(diffs) < 1e-3, diffs
