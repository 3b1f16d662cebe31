"""Vision-language pieces that need no process group and no vLLM: image references and their
checks, placeholder expansion, images carried with their rows, placeholder suppression, M-RoPE
inputs, LoRA on the language model only. The tiny Qwen2.5-VL is built once (a few seconds)."""

from __future__ import annotations

import base64

import pytest
import torch

from fsdp_rlhf.data.images import (
    count_image_items,
    image_problem,
    load_image,
    ref_problem,
    ref_string,
)
from fsdp_rlhf.data.vision import collapse_runs
from fsdp_rlhf.models.vision import ImageBatch, ImageInputs, VisionTokens
from fsdp_rlhf.testing.tiny_vlm import COLOURS, data_uri, png_bytes, solid_image

pytest.importorskip("torchvision")  # the processor needs it (make install has it)

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    return str(build_vl_model(tmp_path_factory.mktemp("tiny_vl")))


@pytest.fixture(scope="module")
def vision(tiny_vl):
    from fsdp_rlhf.data.vision import VisionProcessor

    return VisionProcessor.from_pretrained(tiny_vl)


def test_image_references_of_every_kind_decode(tmp_path):
    image = solid_image(COLOURS["red"], (30, 20))
    path = tmp_path / "a.png"
    image.save(path)
    raw = png_bytes(image)
    refs = [str(path), base64.b64encode(raw).decode(), data_uri(image), raw, {"bytes": raw}]
    for ref in refs:
        assert ref_problem(ref) is None
        decoded = load_image(ref)
        assert decoded.size == (30, 20) and decoded.getpixel((0, 0)) == COLOURS["red"]
    assert ref_string(raw).startswith("data:image/png;base64,")


def test_bad_references_are_named(tmp_path):
    assert "no such file" in ref_problem(str(tmp_path / "missing.png"))
    # a closed local port: the URL check fails fast and says why
    problem = ref_problem("http://127.0.0.1:1/x.png")
    assert "cannot be reached from here" in problem and "local paths" in problem
    assert "must be a path" in ref_problem(3.5)


def _serve(tmp_path):
    """A local HTTP server over ``tmp_path`` (404 for what is not there); its base URL."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_unreadable_images_are_named_from_their_header(tmp_path):
    """Random bytes saved as .png, in every form a row may hold them, and a URL answering 404:
    each is one line naming the image, found before anything loads (the row check)."""
    junk = b"\x89PNG" + bytes(range(7, 250)) * 8  # a PNG's first bytes, then none of a PNG
    (tmp_path / "junk.png").write_bytes(junk)
    solid_image(COLOURS["red"]).save(tmp_path / "ok.png")
    encoded = base64.b64encode(junk).decode()
    refs = (str(tmp_path / "junk.png"), encoded, "data:image/png;base64," + encoded, junk)
    for ref in refs:
        problem = ref_problem(ref)
        assert problem is not None and "is not an image PIL can read" in problem, ref
    deep = tmp_path / ("d" * 90) / "junk.png"  # a long path is named in full, never cut
    deep.parent.mkdir()
    deep.write_bytes(junk)
    assert f"image file '{deep}' is not an image" in ref_problem(str(deep))
    server, base = _serve(tmp_path)
    try:
        assert ref_problem(f"{base}/ok.png") is None
        missing = ref_problem(f"{base}/missing.png")
        assert missing.startswith(f"image URL {base}/missing.png: the server answered 404"), missing
        assert "is not an image PIL can read" in ref_problem(f"{base}/junk.png")
    finally:
        server.shutdown()


def test_placeholders_must_match_images(tmp_path):
    path = tmp_path / "a.png"
    solid_image(COLOURS["blue"]).save(path)
    assert count_image_items(PROMPT) == 1 and count_image_items("text") == 0
    assert image_problem(PROMPT, [str(path)], "images", 0) is None
    assert image_problem(PROMPT, str(path), "images", 0) is None  # one reference, not a list
    two = image_problem(PROMPT, [str(path), str(path)], "images", 0)
    assert "1 image placeholder(s)" in two and "holds 2 image(s)" in two
    assert "more than --max_images_per_prompt 1" in image_problem(
        [{"role": "user", "content": [{"type": "image"}] * 2}], [str(path)] * 2, "images", 1
    )
    assert "text-only" in image_problem(PROMPT, [str(path)], "images", 0, text_only=True)


def test_row_check_names_the_row(tmp_path):
    datasets = pytest.importorskip("datasets")
    from fsdp_rlhf.config import VisionConfig
    from fsdp_rlhf.data.sources import check_rows
    from fsdp_rlhf.errors import UserError
    from fsdp_rlhf.trainers.ppo.vision import row_check

    path = tmp_path / "a.png"
    solid_image(COLOURS["blue"]).save(path)
    rows = datasets.Dataset.from_list(
        [{"prompt": PROMPT, "images": [str(path)]}, {"prompt": PROMPT, "images": []}]
    )
    check = row_check(VisionConfig(), "prompt", text_only=False)
    with pytest.raises(UserError, match=r"--prompt_data x.jsonl: row 2: the prompt has 1 image"):
        check_rows(rows, check, "--prompt_data x.jsonl")
    (tmp_path / "junk.png").write_bytes(b"\x00garbage" * 50)
    rows = datasets.Dataset.from_list(
        [
            {"prompt": PROMPT, "images": [str(path)]},
            {"prompt": PROMPT, "images": [str(tmp_path / "junk.png")]},
        ]
    )
    with pytest.raises(UserError, match=r"--prompt_data x.jsonl: row 2: image file .*junk.png"):
        check_rows(rows, check, "--prompt_data x.jsonl")


def test_collapse_and_expand_round_trip(vision):
    ids = vision.tokenizer(vision.render(PROMPT + PROMPT[:0], True), add_special_tokens=False)
    ids = ids["input_ids"]
    pad = vision.tokens.image
    assert ids.count(pad) == 1
    expanded = vision.expand(ids, [4])
    assert expanded.count(pad) == 4 and collapse_runs(expanded, pad) == ids
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        vision.expand(ids, [4, 4])


def test_token_count_from_size_matches_the_processor(vision):
    for size in ((56, 56), (84, 56), (112, 112), (300, 40)):
        inputs = vision.process([solid_image(COLOURS["green"], size)])
        assert inputs.tokens(vision.tokens.merge_size) == [vision.tokens_for_size(size[1], size[0])]
        assert inputs.pixel_values.dtype == torch.float32


def test_image_batch_follows_its_rows():
    a = ImageInputs(torch.ones(4, 3), torch.tensor([[1, 2, 2]]))
    b = ImageInputs(torch.zeros(16, 3), torch.tensor([[1, 4, 4]]))
    batch = ImageBatch.repeat([a, None, b], 2)  # prompt-major: 2 samples each
    assert len(batch) == 6 and batch.rows[1] is a and batch.rows[2] is None
    assert batch.nbytes == a.nbytes + b.nbytes  # shared copies counted once
    picked = batch[torch.tensor([5, 0])]
    kw = picked.model_kwargs(torch.device("cpu"))
    assert kw["pixel_values"].shape == (20, 3) and kw["image_grid_thw"].tolist() == [
        [1, 4, 4],
        [1, 2, 2],
    ]
    assert batch[2:4].model_kwargs(torch.device("cpu")) == {}
    assert len(ImageBatch.cat([batch, picked])) == 8


def test_token_types_and_inputs_without_images():
    from fsdp_rlhf.models.inputs import forward_inputs

    tokens = VisionTokens(image=6, video=7, start=4, end=5)
    ids = torch.tensor([[0, 4, 6, 6, 5, 9], [4, 7, 7, 5, 9, 9]])
    assert tokens.token_types(ids).tolist() == [[0, 0, 1, 1, 0, 0], [0, 2, 2, 0, 0, 0]]
    assert tokens.placeholders == (6, 7, 4, 5)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    text = forward_inputs(ids, mask, images=ImageBatch([None, None]), vision=tokens).kwargs
    assert text["position_ids"].tolist()[0] == [0, 0, 1, 2, 3, 4] and "pixel_values" not in text


def test_suppressed_tokens_have_no_probability_and_finite_entropy(tiny_vl):
    from fsdp_rlhf.algorithms import gathered_logprobs
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.vision import prepare_policy

    model = load_causal_lm(tiny_vl, BackendConfig(), torch.device("cpu"))
    tokens = prepare_policy(model)
    ids = torch.tensor([[2, 9, 10, 11]])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    probs = logits.detach().float().softmax(-1)
    assert float(probs[..., list(tokens.placeholders)].max()) == 0.0
    labels = torch.tensor([[9, 10, 11, 12]])
    logp, entropy = gathered_logprobs(logits, labels, with_entropy=True)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    (logp.sum() + entropy.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_vlm_loads_with_a_non_causal_vision_tower_and_images_change_logits(tiny_vl, vision):
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.vision import vision_tower

    model = load_causal_lm(tiny_vl, BackendConfig(), torch.device("cpu"))
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert vision_tower(model) is model.model.visual
    ids = vision.tokenizer(vision.render(PROMPT, True), add_special_tokens=False)["input_ids"]

    def logprobs(colour: str, left_pad: int = 0) -> torch.Tensor:
        inputs = vision.process([solid_image(COLOURS[colour])])
        row = [0] * left_pad + vision.expand(ids, inputs.tokens(2)) + [9, 10]
        x = torch.tensor([row])
        mask = (torch.arange(len(row)) >= left_pad).long()[None]
        with torch.no_grad():
            built = forward_inputs(x, mask, images=ImageBatch([inputs]), vision=vision.tokens)
            return response_logprobs(model, built, 2)[0]

    red = logprobs("red")
    assert not torch.allclose(red, logprobs("blue"))  # the pixels reach the logits
    torch.testing.assert_close(red, logprobs("red", left_pad=3))  # M-RoPE over attended tokens


def test_lora_skips_the_vision_tower(tiny_vl):
    from fsdp_rlhf.config import BackendConfig, LoraConfig
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.lora import adapter_config, add_lora, is_adapter_param

    model = load_causal_lm(tiny_vl, BackendConfig(), torch.device("cpu"))
    add_lora(model, LoraConfig(lora_rank=4))
    adapters = [n for n, _ in model.named_parameters() if is_adapter_param(n)]
    assert adapters and all(".language_model." in n for n in adapters)
    assert not any(p.requires_grad for p in model.model.visual.parameters())
    config = adapter_config(model, LoraConfig(lora_rank=4), tiny_vl, None)
    assert "visual" in config["exclude_modules"]


def test_prompts_with_images_count_their_tokens_and_are_never_cut(vision, tmp_path):
    from fsdp_rlhf.config import PromptDataConfig
    from fsdp_rlhf.data.prompts import tokenize_prompts
    from fsdp_rlhf.testing.tiny_vlm import colour_rows

    rows = colour_rows(4, tmp_path)
    cfg = PromptDataConfig(input_key="prompt", label_key="label", apply_chat_template=True)
    prompts = tokenize_prompts(rows, vision.tokenizer, cfg, vision, "images")
    p = prompts[0]
    assert p.image_tokens == (4,) and p.length == len(p.ids) + 3  # one placeholder -> 4 tokens
    short = PromptDataConfig(
        input_key="prompt", apply_chat_template=True, prompt_max_len=p.length - 1
    )
    assert tokenize_prompts(rows, vision.tokenizer, short, vision, "images") == []
