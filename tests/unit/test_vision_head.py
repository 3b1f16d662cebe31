"""A scalar head (critic, reward model) on a vision-language model's language model
(``models.vision_head``): its values are the head applied to the hidden states the causal VLM
feeds its LM head (images merged), at every position, whatever the padding; the checkpoint it
writes is the causal one's tensors (no ``lm_head``) plus ``score.weight``, and loads back to the
same values. Tiny Qwen2.5-VL and Qwen3-VL checkpoints (real processors); Qwen3.5 and
Qwen3.5-MoE VLMs (hybrid linear/full attention) built from configs in memory."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_rlhf.models.vision import ImageBatch, ImageInputs
from fsdp_rlhf.testing.tiny_vlm import COLOURS, solid_image

pytest.importorskip("torchvision")  # the processor needs it (make install has it)

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}]
REL = 1e-5  # fp32 on both sides: the same operations, in the same order


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """arch -> a tiny checkpoint of it, each built once for the module."""
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    paths: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in paths:
            paths[arch] = str(build_vl_model(tmp_path_factory.mktemp(arch), arch=arch))
        return paths[arch]

    return get


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def tiny(request, built) -> str:
    return built(request.param)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |difference| relative to the largest |expected|; asserts it is within REL."""
    rel = float((actual - expected).abs().max() / expected.abs().max())
    assert rel <= REL, rel
    return rel


def _same_weights(a, b) -> None:
    """A save/load round trip is exact in the weights, bit for bit (names, dtypes, values)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, tensor in sa.items():
        assert tensor.dtype == sb[name].dtype and torch.equal(tensor, sb[name]), name


def _inputs(model, ids: torch.Tensor, mask: torch.Tensor, images: ImageBatch):
    """The forward of padded VLM rows with their images (``models.inputs``)."""
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.vision import VisionTokens

    return forward_inputs(ids, mask, images=images, vision=VisionTokens.from_config(model.config))


def _lm_head_inputs(causal, inputs: dict) -> torch.Tensor:
    """The hidden states the causal VLM's LM head reads at every position: (B, L, H)."""
    seen: list[torch.Tensor] = []
    head = causal.get_output_embeddings()
    handle = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    try:
        causal(**inputs)
    finally:
        handle.remove()
    return seen[0]


def _rows(path: str):
    """Two rows, red (right-padded) and blue (left-padded, longer), their images, and each row
    alone (unpadded)."""
    from fsdp_rlhf.data.vision import VisionProcessor

    vision = VisionProcessor.from_pretrained(path)
    prompt = vision.tokenizer(vision.render(PROMPT, True), add_special_tokens=False)["input_ids"]
    alone = []
    for colour, answer in (("red", [9, 10]), ("blue", [9, 10, 11, 12, 13])):
        inputs = vision.process([solid_image(COLOURS[colour])])
        ids = vision.expand(prompt, inputs.tokens(vision.tokens.merge_size)) + answer
        alone.append((torch.tensor([ids]), inputs))
    L = max(ids.shape[1] for ids, _ in alone) + 2
    batch_ids = torch.zeros(2, L, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.long)
    (red, _), (blue, _) = alone
    batch_ids[0, : red.shape[1]], mask[0, : red.shape[1]] = red[0], 1  # right padding
    batch_ids[1, L - blue.shape[1] :], mask[1, L - blue.shape[1] :] = blue[0], 1  # left
    images = ImageBatch([inputs for _, inputs in alone])
    return alone, batch_ids, mask, images


def test_values_are_the_head_on_the_language_models_hidden_states(tiny):
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.forward import sequence_scores, token_values
    from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model
    from fsdp_rlhf.models.vision import vision_tower

    cpu = torch.device("cpu")
    critic = load_scalar_model(tiny, BackendConfig(), cpu)
    causal = load_causal_lm(tiny, BackendConfig(), cpu)
    assert type(critic).__name__.endswith("ForSequenceClassification")
    assert vision_tower(critic) is critic.model.visual
    assert critic.config.vision_config._attn_implementation == "sdpa"  # non-causal tower
    alone, ids, mask, images = _rows(tiny)
    with torch.no_grad():
        values = token_values(critic, _inputs(critic, ids, mask, images))
        scores = sequence_scores(critic, _inputs(critic, ids, mask, images))
        hidden = _lm_head_inputs(causal, _inputs(critic, ids, mask, images).kwargs)
        expected = (hidden @ critic.score.weight.T).squeeze(-1)
        attended = mask.bool()
        rel = _close(values[attended], expected[attended])
        # each row alone, unpadded: the same values at its tokens (left and right padding)
        padding = 0.0
        for row, (x, inputs) in enumerate(alone):
            one = token_values(
                critic, _inputs(critic, x, torch.ones_like(x), ImageBatch([inputs]))
            )[0]
            padding = max(padding, _close(values[row][attended[row]], one))
            _close(scores[row : row + 1], one[-1:])
        # the pixels reach the values: the red row with the blue image differs
        swapped = token_values(critic, _inputs(critic, ids[:1], mask[:1], images[[1]]))
        assert (swapped - values[:1]).abs().max() > 1e-4
    print(f"{tiny}: relative difference to head(hidden) {rel:.1e}, padded/alone {padding:.1e}")


def test_scalar_checkpoint_format_and_round_trip(tiny, tmp_path):
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.forward import token_values
    from fsdp_rlhf.models.load import load_scalar_model

    cpu = torch.device("cpu")
    critic = load_scalar_model(tiny, BackendConfig(), cpu)
    critic.save_pretrained(tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert config["architectures"] == [type(critic).__name__] and config["vision_config"]
    assert len(config["id2label"]) == 1
    causal = _checkpoint_keys(tiny)
    # the causal checkpoint's names (Qwen2.5-VL: the published `model.layers.*`, `visual.*`)
    assert _checkpoint_keys(tmp_path / "critic") == (causal - {"lm_head.weight"}) | {"score.weight"}
    # loads back (no head initialised: it must be in the folder), as the skeleton too
    saved = str(tmp_path / "critic")
    again = load_scalar_model(saved, BackendConfig(), cpu, init_head_if_missing=False)
    skeleton = load_scalar_model(saved, BackendConfig(), cpu, weights=False)
    shapes = {n: p.shape for n, p in again.named_parameters()}
    assert shapes == {n: p.shape for n, p in skeleton.named_parameters()}
    _, ids, mask, images = _rows(tiny)
    with torch.no_grad():
        before = token_values(critic, _inputs(critic, ids, mask, images))
        after = token_values(again, _inputs(again, ids, mask, images))
    # the weights are bit for bit; values computed from them need not be: a CPU kernel's bits
    # can depend on its buffers' alignment and the ISA (AMX, AVX512, AVX2)
    _same_weights(critic, again)
    _close(after, before)


def _checkpoint_keys(path) -> set[str]:
    from pathlib import Path

    from safetensors import safe_open

    keys: set[str] = set()
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys.update(st.keys())
    return keys


def _qwen3_5_vlm(moe: bool):
    """A Qwen3.5 (or Qwen3.5-MoE) VLM config in memory: the hybrid text model of
    ``testing.tiny`` (a gated-delta-net layer, a full-attention one), a one-block vision tower
    with 16-px patches merged 2x2, and M-RoPE sections over its 8 rotary frequencies."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    from fsdp_rlhf.testing.tiny import _QWEN3_5_HYBRID

    text = dict(
        **_QWEN3_5_HYBRID,
        num_hidden_layers=2,
        vocab_size=64,
        pad_token_id=0,
        eos_token_id=1,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        text.update(shared_expert_intermediate_size=32)
    else:
        text.update(intermediate_size=128)
    vision = dict(
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=128,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
    )
    special = dict(image_token_id=60, video_token_id=61, vision_start_token_id=62)
    cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return cls(text_config=text, vision_config=vision, vision_end_token_id=63, **special)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_vlm_values_and_round_trip(moe, tmp_path):
    from transformers import AutoModelForImageTextToText

    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.forward import token_values
    from fsdp_rlhf.models.load import load_scalar_model
    from fsdp_rlhf.models.vision_head import vision_scalar_class

    config = _qwen3_5_vlm(moe)
    name = "Qwen3_5MoeForSequenceClassification" if moe else "Qwen3_5ForSequenceClassification"
    torch.manual_seed(0)
    causal = AutoModelForImageTextToText.from_config(config).float().eval()
    causal.save_pretrained(tmp_path / "causal")
    critic = load_scalar_model(str(tmp_path / "causal"), BackendConfig(), torch.device("cpu"))
    assert type(critic).__name__ == name and type(critic) is vision_scalar_class(config)
    torch.manual_seed(1)
    pixels = torch.randn(16, 3 * 2 * 16 * 16)  # one image of 4x4 patches: 4 tokens
    image = ImageInputs(pixel_values=pixels, grid_thw=torch.tensor([[1, 4, 4]]))
    row = [5, 62, 60, 60, 60, 60, 63, 7, 8, 9, 10]
    ids, mask = torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long)
    images = ImageBatch([image])
    with torch.no_grad():
        values = token_values(critic, _inputs(critic, ids, mask, images))
        inputs = _inputs(critic, ids, mask, images).kwargs
        hidden = _lm_head_inputs(causal, inputs)
        _close(values[0], (hidden @ critic.score.weight.T)[0, :, 0])
        critic.save_pretrained(tmp_path / "critic")
        saved = str(tmp_path / "critic")
        again = load_scalar_model(saved, BackendConfig(), torch.device("cpu"))
        _same_weights(critic, again)
        _close(token_values(again, _inputs(again, ids, mask, images)), values)


def test_ppo_values_and_scores_take_each_rows_images(built):
    """The experience forwards (``batched_values``, ``batched_scores``) hand each micro-batch's
    images to a VLM critic and reward model: one row per micro-batch gives what the whole
    padded batch gives, and dropping the images changes the result."""
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.forward import sequence_scores, token_values
    from fsdp_rlhf.models.inputs import InputSpec
    from fsdp_rlhf.models.load import load_scalar_model
    from fsdp_rlhf.models.vision import VisionTokens
    from fsdp_rlhf.trainers.experience import Experience, batched_scores, batched_values

    path = built("qwen2_5_vl")
    critic = load_scalar_model(path, BackendConfig(), torch.device("cpu"))
    _, ids, mask, images = _rows(path)
    # the second row is left-padded: as rollouts are, prompt left, response right (T = 2)
    T = 2
    response_mask = mask[:, -T:].float()
    exp = Experience(
        input_ids=ids,
        attention_mask=mask,
        response_mask=response_mask,
        engine_logprobs=torch.zeros_like(response_mask),
        images=images,
    )
    with torch.no_grad():
        whole = (
            token_values(critic, _inputs(critic, ids, mask, images))[:, -T - 1 : -1] * response_mask
        )
        spec = InputSpec("padded", vision=VisionTokens.from_config(critic.config))
        _close(batched_values(critic, exp, 1, spec), whole)
        _close(
            batched_scores(critic, exp, 1, spec),
            sequence_scores(critic, _inputs(critic, ids, mask, images)),
        )
        blind = batched_values(critic, Experience(**{**exp.__dict__, "images": None}), 1, spec)
    assert (blind - whole).abs().max() > 1e-4


def test_a_vlm_actor_refuses_a_critic_that_cannot_see_its_images(built, tmp_path):
    """The rules table's rows about a VLM actor's critic and reward model (read from the
    models' kinds): one of the actor's family passes, a text-only one and one with other
    patches are refused by name."""
    from transformers import Qwen2Config

    from fsdp_rlhf.models.kind import read_model_kind
    from fsdp_rlhf.rules import RULES, Setting

    actor, other = built("qwen2_5_vl"), built("qwen3_vl")
    Qwen2Config(hidden_size=64, num_attention_heads=2).save_pretrained(tmp_path / "text")
    rows = {r.id: r for r in RULES}

    def refused(flag: str, path: str) -> list[str]:
        models = {
            "--pretrain": read_model_kind(actor, "--pretrain"),
            flag: read_model_kind(path, flag),
        }
        lines = [
            rows[f"vlm-{k}-{w}"].message(Setting("ppo", None, models))
            for k in ("text", "other-family")
            for w in ("critic", "reward-model")
        ]
        return [line for line in lines if line is not None]

    for flag in ("--critic_pretrain", "--reward_pretrain"):
        assert refused(flag, actor) == []
        (text,) = refused(flag, str(tmp_path / "text"))
        assert f"{flag} {tmp_path / 'text'} is text-only" in text
        # the same tokenizer, other patches (14 px against 16 px)
        (patches,) = refused(flag, other)
        assert "vision_config.patch_size" in patches and flag in patches


def test_lora_on_a_vlm_critic_skips_the_tower_and_trains_the_head(built):
    from fsdp_rlhf.config import BackendConfig, LoraConfig
    from fsdp_rlhf.models.load import load_scalar_model
    from fsdp_rlhf.models.lora import add_lora, is_adapter_param

    critic = load_scalar_model(built("qwen2_5_vl"), BackendConfig(), torch.device("cpu"))
    add_lora(critic, LoraConfig(lora_rank=4), head="score")
    trainable = [n for n, p in critic.named_parameters() if p.requires_grad]
    adapters = [n for n in trainable if is_adapter_param(n)]
    assert adapters and all(".language_model." in n for n in adapters)
    assert {n for n in trainable if not is_adapter_param(n)} == {
        next(n for n in trainable if n.endswith("score.weight"))
    }
