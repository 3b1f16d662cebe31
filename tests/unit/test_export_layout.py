"""The HF export keeps the trained checkpoint's tensor layout: Qwen3-VL-MoE's fused experts are
(E, H, 2I) and (E, I, H) in the published checkpoints (what vLLM's loader reads) and (E, 2I, H)
and (E, H, I) in transformers' model, and ``save_pretrained`` alone writes the latter."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.models.checkpoint_format import checkpoint_shapes
from fsdp_rlhf.models.save import match_checkpoint_layout, save_hf_model


@pytest.fixture(scope="module")
def vl_moe(tmp_path_factory):
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    return build_vl_model(tmp_path_factory.mktemp("vl_moe"), "qwen3_vl_moe")


def _load(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)


def test_a_qwen3_vl_moe_export_has_the_published_expert_layout(vl_moe, tmp_path):
    model = _load(vl_moe)
    plain = tmp_path / "plain"
    model.save_pretrained(str(plain))
    source, written = checkpoint_shapes(vl_moe), checkpoint_shapes(plain)
    experts = sorted(k for k in source if k.endswith(("experts.gate_up_proj", "experts.down_proj")))
    assert len(experts) == 4 and all(written[k] != source[k] for k in experts)  # the bug
    assert sorted(match_checkpoint_layout(plain, vl_moe)) == experts
    assert checkpoint_shapes(plain) == source

    out = save_hf_model(model, None, tmp_path / "export", layout_of=str(vl_moe))
    assert checkpoint_shapes(out) == source
    again = _load(out)  # transformers' loader transposes them into its own layout again
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_other_models_are_written_as_save_pretrained_writes_them(tmp_path):
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    source = build_vl_model(tmp_path / "vl")  # Qwen2.5-VL: nothing is transposed on load
    model = _load(source)
    out = save_hf_model(model, None, tmp_path / "export", layout_of=str(source))
    assert checkpoint_shapes(out) == checkpoint_shapes(source)
    assert match_checkpoint_layout(out, source) == []
    assert match_checkpoint_layout(out, "Qwen/not-a-local-folder") == []
