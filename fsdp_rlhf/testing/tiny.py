"""Build small Qwen2/Llama models and a BPE tokenizer locally (no downloads).

Used by the tests, the demo and the benchmark. head_dim is 64 because vLLM's CPU attention
rejects smaller heads ("Unsupported CPU attention configuration" at 16).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

WORDS = (
    "the a an cat dog bird fish tree sun moon star red blue green good bad happy sad big small "
    "runs jumps sings eats sleeps sees likes hates and or but with on in under over near far "
    "one two three four five six seven eight nine ten yes no hello thanks please sorry human "
    "assistant question answer why how what when where who kind helpful honest harmless"
).split()


def synthetic_corpus(
    n_lines: int = 2000, seed: int = 0, words: tuple[str, ...] | list[str] = WORDS
) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(n_lines)]


def build_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 512,
    *,
    special_tokens: list[str] = SPECIAL_TOKENS,
    words: tuple[str, ...] | list[str] = WORDS,
    chat_template: str = CHAT_TEMPLATE,
):
    """Train a byte-level BPE tokenizer on synthetic text of ``words``; save it with a chat
    template. ``special_tokens`` start with pad and EOS, as ``SPECIAL_TOKENS`` do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(synthetic_corpus(words=words), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=special_tokens[0],
        eos_token=special_tokens[1],
        bos_token=None,
        additional_special_tokens=special_tokens[2:],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


# Shapes as published checkpoints have them, scaled down. Qwen2/2.5 config.json files carry no
# head_dim (transformers derives hidden_size // num_attention_heads); Llama-family small models
# (SmolLM-135M: hidden 576, 9 query / 3 KV heads) use an odd GQA ratio and tied embeddings.
# head_dim stays 64 in both: vLLM's CPU attention rejects smaller heads.
SHAPES = {
    "qwen2": dict(hidden_size=128, num_heads=2, num_kv_heads=2, tie_word_embeddings=False),
    "llama": dict(
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=512,
        tie_word_embeddings=True,
    ),
}


def build_model(
    out_dir: str | Path,
    arch: Literal["qwen2", "llama"] = "qwen2",
    *,
    num_layers: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    **shape,
) -> Path:
    """Save a randomly initialised causal LM, its tokenizer and a generation_config.json to
    ``out_dir``; returns the path. ``shape`` overrides ``SHAPES[arch]`` (hidden_size, num_heads,
    num_kv_heads, intermediate_size, tie_word_embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    unknown = set(shape) - {"intermediate_size", *SHAPES["qwen2"]}
    if unknown:
        raise TypeError(f"build_model: unknown shape arguments {sorted(unknown)}")
    s = {**SHAPES[arch], **shape}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    common = dict(
        vocab_size=len(tok),
        hidden_size=s["hidden_size"],
        intermediate_size=s.get("intermediate_size") or 4 * s["hidden_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"] or s["num_heads"],
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=s["tie_word_embeddings"],
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(str(out))
    if arch == "qwen2":
        _drop_config_keys(out, ("head_dim",))
    write_generation_config(out, tok)
    return out


def _drop_config_keys(model_dir: Path, keys: tuple[str, ...]) -> None:
    """Remove keys a transformers version may serialise but published configs lack."""
    cfg_file = model_dir / "config.json"
    cfg = json.loads(cfg_file.read_text())
    for key in keys:
        cfg.pop(key, None)
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_generation_config(model_dir: Path, tok) -> None:
    """A generation_config.json like a chat checkpoint's: two EOS ids (end of turn first) and
    sampling defaults that a trainer must not pick up silently (its own flags rule)."""
    cfg = {
        "bos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id],
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    (model_dir / "generation_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
