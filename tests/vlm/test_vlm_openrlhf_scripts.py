"""OpenRLHF's vision-language recipe (train_vlm_math_hybrid_engine.sh: images under
--data.image_key, --data.max_images_per_prompt 1, --actor.freeze_visual_encoder, a critic-free
estimator) in both dialects, run with only the entry point swapped, on a tiny Qwen2.5-VL."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import read_metrics
from tests.e2e.test_openrlhf_scripts import run_script, translated

pytestmark = [pytest.mark.vlm, pytest.mark.slow]


@pytest.mark.parametrize(
    ("script", "spelling"),
    [
        ("vlm_v0.11_dotted.sh", "--data.image_key images -> --image_key images"),
        ("vlm_v0.10_flat.sh", None),
    ],
)
def test_vlm_script(script, spelling, tiny_vl, vl_colour_data, tmp_path):
    save = tmp_path / "vlm"
    proc = run_script(script, tiny_vl, vl_colour_data, save)
    assert proc.returncode == 0, proc.stderr[-4000:]
    notes = translated(proc.stdout)
    if spelling is not None:
        assert any(spelling in n for n in notes), notes
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]  # --max_samples 16 / --rollout_batch_size 8
    for r in rows:
        assert 0 < r["response_length/max"] <= 8 and 0 <= r["critic/score/mean"] <= 1
    config = (save / "config.yaml").read_text()
    for line in ("image_key: images", "max_images_per_prompt: 1", "freeze_visual_encoder: true"):
        assert line in config, line
    assert "advantage_estimator: reinforce_baseline" in config
    # the export is a VLM folder with its processor (image processor, tokenizer, template)
    saved = json.loads((save / "config.json").read_text())
    assert saved["vision_config"] and saved["architectures"] == [
        "Qwen2_5_VLForConditionalGeneration"
    ]
    assert (save / "preprocessor_config.json").is_file() or (
        save / "processor_config.json"
    ).is_file()
