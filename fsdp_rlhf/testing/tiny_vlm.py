"""Build small vision-language checkpoints (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5-MoE),
their processors and image data locally (no downloads).

The processor is the real one (``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor`` with the Qwen2-VL
image processor), configured for small images: one merged image token covers 28x28 px
(Qwen2.5-VL; 32x32 for Qwen3-VL) and images are resized to 56..112 px a side, so an image costs
4 to 16 tokens. Text head_dim stays 64 (vLLM's CPU attention rejects smaller heads); the M-RoPE
sections sum to head_dim / 2 as in published configs.

The MoE ones keep what the published checkpoints' structure asks of the trainer and vLLM:
``qwen3_vl_moe`` (Qwen/Qwen3-VL-30B-A3B-Instruct) has every text layer sparse (16 experts, top
4, softmax router renormalised) and Qwen3-VL's vision tower with deepstack features;
``qwen3_5_moe`` (Qwen/Qwen3.5-35B-A3B, whose text and vision config Qwen3.6-35B-A3B shares)
has hybrid text layers (gated-delta-net linear attention, then gated full attention with a
quarter of each head rotated, interleaved M-RoPE sections over those frequencies), every layer
sparse with a gated shared expert, and a vision tower without deepstack. Its linear-attention
heads are 128 wide (vLLM's CPU gated-delta-net kernel takes 128 only, and bf16 only).

Two tokenizers: the byte-level BPE of ``testing.tiny`` (vocabulary 512, like the text models),
or with ``words`` a word-level one whose vocabulary is those words and the special tokens. The
second makes an answer from a small set likely enough for a randomly initialised policy to find
by sampling (``tests/vlm/test_vlm_grpo.py``).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Literal

import torch

from fsdp_rlhf.testing.tiny import SPECIAL_TOKENS, WORDS, build_tokenizer, write_generation_config

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_SPECIAL_TOKENS = SPECIAL_TOKENS + VISION_TOKENS
# The Qwen-VL template shape: a message's content is a string or a list of typed items; an
# image item renders as <|vision_start|><|image_pad|><|vision_end|> (one pad: the processor
# expands it to the image's token count).
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_WORDS = [*WORDS, *"what colour image picture square shape show".split()]
COLOURS = {"red": (230, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 230)}
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112

Arch = Literal["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe"]
# every text layer sparse: 16 experts, top 4 (published: 128/256 experts, top 8)
_MOE = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64)


def build_word_tokenizer(out_dir: str | Path, words: list[str] | tuple[str, ...]):
    """A word-level tokenizer: the special tokens, ``words`` and an unknown token, split on
    whitespace (decoding joins words with spaces); saved with the VL chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*VL_SPECIAL_TOKENS, "<unk>", *dict.fromkeys(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=VL_SPECIAL_TOKENS[0],
        eos_token=VL_SPECIAL_TOKENS[1],
        unk_token="<unk>",
        bos_token=None,
        additional_special_tokens=VL_SPECIAL_TOKENS[2:],
    )
    fast.chat_template = VL_CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def _processor(arch: Arch, tokenizer):
    from transformers import Qwen2VLImageProcessor

    sizes = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

        image = Qwen2VLImageProcessor(**sizes)
        video = Qwen2VLVideoProcessor(**sizes)
        cls = Qwen2_5_VLProcessor
    else:
        from transformers import Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        image = Qwen2VLImageProcessor(patch_size=16, merge_size=2, **sizes)
        video = Qwen3VLVideoProcessor(patch_size=16, merge_size=2)
        cls = Qwen3VLProcessor
    return cls(
        image_processor=image,
        tokenizer=tokenizer,
        video_processor=video,
        chat_template=VL_CHAT_TEMPLATE,
    )


def _text_config(arch: Arch, tok, num_layers: int, tie: bool) -> dict:
    ids = {t: tok.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        pad_token_id=ids["<pad>"],
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=None,
        tie_word_embeddings=tie,
    )
    # sections of the 32 rotary frequencies of a 64-wide head: time, height, width
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}
    if arch != "qwen2_5_vl":
        text["head_dim"] = 64
        rope.update(rope_theta=5e6, mrope_interleaved=True)
    if arch == "qwen3_vl_moe":
        # norm_topk_prob: in the published config.json (transformers' router renormalises
        # always and has no such key; vLLM's Qwen3-VL-MoE reads it)
        text.update(
            _MOE,
            moe_intermediate_size=32,  # 2I != H: the fused tensors' transpose is unambiguous
            num_attention_heads=4,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    if arch == "qwen3_5_moe":
        # published: head_dim 256, a quarter rotated, sections [11, 11, 10] of its 32
        # frequencies; here 16 of 64 dims rotated, 8 frequencies
        rope.update(rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[3, 3, 2])
        text.update(
            _MOE,
            num_attention_heads=4,
            shared_expert_intermediate_size=64,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"] * (num_layers // 2)
            + ["linear_attention"] * (num_layers % 2),
        )
    text["rope_parameters"] = rope
    return text


def _vision_config(arch: Arch) -> dict:
    if arch == "qwen2_5_vl":
        return dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=128,
            fullatt_block_indexes=[1],
            window_size=56,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=128,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
    )
    if arch != "qwen3_5_moe":  # Qwen3.5's tower has no deepstack features
        vision["deepstack_visual_indexes"] = [0]
    return vision


_CONFIG_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLConfig",
    "qwen3_vl": "Qwen3VLConfig",
    "qwen3_vl_moe": "Qwen3VLMoeConfig",
    "qwen3_5_moe": "Qwen3_5MoeConfig",
}


def _config(arch: Arch, tok, num_layers: int, tie: bool):
    import transformers

    ids = {t: tok.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS}
    special = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie,
    )
    cls = getattr(transformers, _CONFIG_CLASSES[arch])
    return cls(
        text_config=_text_config(arch, tok, num_layers, tie),
        vision_config=_vision_config(arch),
        **special,
    )


def build_vl_model(
    out_dir: str | Path,
    arch: Arch = "qwen2_5_vl",
    *,
    num_layers: int = 2,
    words: list[str] | tuple[str, ...] | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised VLM, its processor (tokenizer, image and video processors,
    chat template) and a generation_config.json to ``out_dir``; returns the path.

    ``words``: a word-level vocabulary (see the module docstring) instead of the 512-token BPE.
    """
    from transformers import AutoModelForImageTextToText

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if words is None:
        tok = build_tokenizer(
            out,
            special_tokens=VL_SPECIAL_TOKENS,
            words=VL_WORDS,
            chat_template=VL_CHAT_TEMPLATE,
        )
    else:
        tok = build_word_tokenizer(out, words)
    _processor(arch, tok).save_pretrained(str(out))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(
        _config(arch, tok, num_layers, tie_word_embeddings)
    )
    model.to(torch.float32).save_pretrained(str(out))
    if arch == "qwen3_vl_moe":
        _published_expert_layout(out)
    write_generation_config(out, tok)
    return out


def _published_expert_layout(out: Path) -> None:
    """Qwen3-VL-MoE's published checkpoints hold the fused experts as (E, H, 2I) and (E, I, H),
    transposed from transformers' (E, 2I, H) and (E, H, I), which its loader converts (and
    vLLM's reads); ``save_pretrained`` of a model built from a config writes transformers'
    layout, so the file is rewritten in the published one (temp, then rename)."""
    from safetensors import safe_open

    from fsdp_rlhf.models.save import transpose_in_file

    path = out / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        names = [
            k for k in f.keys() if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        ]
    transpose_in_file(path, names)


# ---------------------------------------------------------------- images


def solid_image(rgb: tuple[int, int, int], size: tuple[int, int] = (56, 56)):
    """A PIL image of one colour (width, height)."""
    from PIL import Image

    return Image.new("RGB", size, rgb)


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def colour_rows(
    n: int,
    image_dir: str | Path,
    *,
    seed: int = 0,
    colours: dict[str, tuple[int, int, int]] = COLOURS,
    blank: bool = False,
    encoding: Literal["path", "base64", "data_uri"] = "path",
    question: str = "what colour",
    names: list[str] | None = None,
) -> list[dict]:
    """Prompt rows asking for the colour of a solid-colour image, OpenRLHF's layout:
    ``prompt`` (a chat message with an image item and the question), ``images`` (one path,
    base64 string or data URI) and ``label`` (the colour's name).

    ``blank``: every image is the same grey whatever the label (the control: the pixels then
    carry no information about the answer). ``names``: the rows' colours in order (default:
    drawn with ``seed``).
    """
    import random

    rng = random.Random(seed)
    folder = Path(image_dir)
    folder.mkdir(parents=True, exist_ok=True)
    order, names = names, list(colours)
    rows = []
    for i in range(n):
        name = order[i] if order is not None else names[rng.randrange(len(names))]
        image = solid_image((128, 128, 128) if blank else colours[name])
        if encoding == "path":
            path = folder / f"{i:05d}.png"
            image.save(path)
            ref = str(path)
        elif encoding == "base64":
            ref = base64.b64encode(png_bytes(image)).decode()
        else:
            ref = data_uri(image)
        content = [{"type": "image"}, {"type": "text", "text": question}]
        rows.append(
            {"prompt": [{"role": "user", "content": content}], "images": [ref], "label": name}
        )
    return rows


def write_rows(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mixed_image_rows(vision, response_len: int, *, seed: int = 0):
    """Four (prompt | response) rows for exactness tests of a VLM's forwards: images of three
    sizes (2x2, 4x2 and 2x4 merged tokens: different M-RoPE grids) and a text-only row,
    prompts left-padded, responses of random tokens right-padded to ``response_len``.
    ``vision``: a ``data.vision.VisionProcessor``. Returns ``(input_ids, attention_mask,
    ImageBatch)`` with rows (4, P + T)."""
    from fsdp_rlhf.models.vision import ImageBatch

    processor = vision.image_processor
    merged = processor.patch_size * processor.merge_size  # pixels a side of one merged token
    sizes = [(2, 2), None, (4, 2), (2, 4)]
    names = list(COLOURS)
    prompts, images = [], []
    for k, size in enumerate(sizes):
        content = [{"type": "text", "text": "what colour"}]
        inputs = None
        if size is not None:
            content.insert(0, {"type": "image"})
            picture = solid_image(COLOURS[names[k % 3]], (size[0] * merged, size[1] * merged))
            inputs = vision.process([picture])
        text = vision.render([{"role": "user", "content": content}], True)
        ids = vision.tokenizer(text, add_special_tokens=False)["input_ids"]
        if inputs is not None:
            ids = vision.expand(ids, inputs.tokens(vision.tokens.merge_size))
        prompts.append(ids)
        images.append(inputs)
    g = torch.Generator().manual_seed(seed)
    T, P, B = response_len, max(len(p) for p in prompts), len(prompts)
    ids = torch.zeros(B, P + T, dtype=torch.long)
    mask = torch.zeros(B, P + T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) : P] = torch.tensor(p)
        n = T - i % 3
        ids[i, P : P + n] = torch.randint(len(VL_SPECIAL_TOKENS) + 1, 200, (n,), generator=g)
        mask[i, P - len(p) : P + n] = 1
    return ids, mask, ImageBatch(images)
