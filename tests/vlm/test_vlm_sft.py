"""SFT on image-caption rows (a chat prompt with an image item, the colour's name as the
answer) lowers the held-out loss of a tiny Qwen2.5-VL; the export loads in transformers with
its processor and in vLLM, and both answer the held-out images alike."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import read_metrics, torchrun

pytestmark = [pytest.mark.vlm, pytest.mark.slow]


def _hf_answers(path: str, rows: list[dict]) -> list[str]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from fsdp_rlhf.data.images import load_images

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for row in rows:
        text = processor.apply_chat_template(row["prompt"], add_generation_prompt=True)
        inputs = processor(text=[text], images=load_images(row["images"]), return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        new = ids[0, inputs["input_ids"].shape[1] :]
        out.append(processor.tokenizer.decode(new, skip_special_tokens=True).strip())
    return out


def _vllm_answers(path: str, rows: list[dict]) -> list[str]:
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    from fsdp_rlhf.data.images import load_images

    processor = AutoProcessor.from_pretrained(path)
    llm = LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        kv_cache_memory_bytes=1 << 28,
        limit_mm_per_prompt={"image": 1},
        seed=0,
    )
    prompts = [
        {
            "prompt": processor.apply_chat_template(r["prompt"], add_generation_prompt=True),
            "multi_modal_data": {"image": load_images(r["images"])},
        }
        for r in rows
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].text.strip() for o in outs]


def test_sft_on_image_captions_lowers_held_out_loss_and_exports_a_vlm(
    tiny_vl, vl_colour_data, tmp_path
):
    out = tmp_path / "sft"
    proc = torchrun(
        [
            "sft", "--pretrain", tiny_vl,
            "--dataset", str(vl_colour_data / "prompts.jsonl"),
            "--eval_dataset", str(vl_colour_data / "eval.jsonl"),
            "--input_key", "prompt", "--output_key", "label", "--image_key", "images",
            "--apply_chat_template", "--save_path", str(out),
            "--train_batch_size", "16", "--micro_train_batch_size", "4",
            "--learning_rate", "3e-3", "--max_len", "48", "--logging_steps", "4",
            "--eval_steps", "4", "--max_epochs", "3", "--packing_samples",  # packed, with images
        ],
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    evals = [r["eval/loss"] for r in read_metrics(out) if "eval/loss" in r]
    print("eval/loss", evals)
    assert len(evals) >= 3 and evals[-1] < 0.5 * evals[0], evals
    saved = json.loads((out / "config.json").read_text())
    assert saved["vision_config"]
    held_out = [json.loads(line) for line in (vl_colour_data / "eval.jsonl").open()][:12]
    hf = _hf_answers(str(out), held_out)
    accuracy = sum(a.split()[:1] == [r["label"]] for a, r in zip(hf, held_out, strict=True)) / len(
        held_out
    )
    print("hf answers", hf, "accuracy", accuracy)
    assert accuracy >= 0.75, hf
    assert _vllm_answers(str(out), held_out) == hf
