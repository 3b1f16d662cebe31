"""Build small models and a BPE tokenizer locally (no downloads).

Used by the tests, the demo and the benchmark. head_dim is 64 because vLLM's CPU attention
rejects smaller heads ("Unsupported CPU attention configuration" at 16).

:func:`build_model` makes the Qwen2/Llama shapes most tests use; :func:`build_family` makes one
of :data:`FAMILIES`, each scaled down from a published checkpoint's config with its structure
kept (the family matrix, ``make test-models``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
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


# ---------------------------------------------------------------- the family matrix


@dataclass(frozen=True)
class Family:
    """A model family as a published checkpoint configures it, scaled down.

    ``config`` holds the transformers config arguments besides the vocabulary and special
    tokens; ``published`` names the checkpoint whose config.json the structure follows, and
    ``kept`` what of it the tiny model keeps (what the trainer and vLLM must handle).
    """

    name: str
    config_class: str
    model_class: str
    published: str
    kept: str
    config: dict = field(default_factory=dict)
    drop_keys: tuple[str, ...] = ()
    num_layers: int | None = None  # None: build_family's num_layers

    @property
    def moe(self) -> bool:
        return any(key in self.config for key in _EXPERT_KEYS)


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


# Qwen3.5's hybrid text model, shared by the dense and the MoE family
_QWEN3_5_HYBRID = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=128,  # vLLM's CPU gated-delta-net kernel takes 128 only
    linear_value_head_dim=128,
    layer_types=["linear_attention", "full_attention"],
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen2",
            "Qwen2Config",
            "Qwen2ForCausalLM",
            "Qwen/Qwen2.5-7B-Instruct",
            "no head_dim key in config.json, q/k/v biases, untied head",
            dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2),
            drop_keys=("head_dim",),
        ),
        Family(
            "qwen3",
            "Qwen3Config",
            "Qwen3ForCausalLM",
            "Qwen/Qwen3-0.6B",
            "explicit head_dim with heads x head_dim != hidden, q/k RMSNorm, GQA 2:1, tied",
            dict(
                hidden_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                tie_word_embeddings=True,
            ),
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            "Qwen/Qwen3-30B-A3B",
            "every layer sparse: softmax top-k router with renormalised weights (16 experts, "
            "top 4), fused expert tensors, GQA 4:1, q/k RMSNorm, untied",
            dict(
                hidden_size=128,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=64,
                num_experts=16,
                num_experts_per_tok=4,
                moe_intermediate_size=64,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            "Qwen/Qwen1.5-MoE-A2.7B",
            "softmax top-k router without renormalisation (8 experts, top 2), a shared expert "
            "behind a sigmoid gate, q/k/v biases, untied",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=128,
                norm_topk_prob=False,
            ),
        ),
        Family(
            "llama3",
            "LlamaConfig",
            "LlamaForCausalLM",
            "meta-llama/Llama-3.2-1B-Instruct",
            "llama3 rope scaling, GQA at the odd ratio 9/3 (SmolLM's), tied",
            dict(
                hidden_size=576,
                num_attention_heads=9,
                num_key_value_heads=3,
                intermediate_size=512,
                tie_word_embeddings=True,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            ),
        ),
        Family(
            "gemma3",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            "google/gemma-3-1b-it",
            "a sliding-window layer (window cut to 16 tokens so rollouts exceed it) and a global "
            "one with their own rope bases, q/k RMSNorm, scaled embeddings, GELU-tanh, tied",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=64,
                query_pre_attn_scalar=64,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
                tie_word_embeddings=True,
            ),
        ),
        Family(
            "mistral",
            "MistralConfig",
            "MistralForCausalLM",
            "mistralai/Mistral-7B-Instruct-v0.3",
            "GQA 4:1, no sliding window (v0.3), untied",
            dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64),
        ),
        Family(
            "phi3",
            "Phi3Config",
            "Phi3ForCausalLM",
            "microsoft/Phi-3-mini-4k-instruct",
            "fused qkv_proj and gate_up_proj weights, untied",
            dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2),
        ),
        Family(
            "qwen3_5",
            "Qwen3_5TextConfig",
            "Qwen3_5ForCausalLM",
            "Qwen/Qwen3.5-9B (its text model)",
            "hybrid: a gated-delta-net linear-attention layer (key/value heads of 128, as "
            "published) and a gated full-attention layer (published: 3 linear to 1 full), q/k "
            "RMSNorm, partial rotary, GQA 2:1",
            _QWEN3_5_HYBRID,
        ),
        Family(
            "qwen3_5_moe",
            "Qwen3_5MoeTextConfig",
            "Qwen3_5MoeForCausalLM",
            "Qwen/Qwen3.5-35B-A3B (its text model)",
            "hybrid linear/full attention as qwen3_5, every layer sparse (16 experts, top 4) "
            "with a gated shared expert",
            dict(
                **_QWEN3_5_HYBRID,
                num_experts=16,
                num_experts_per_tok=4,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
            ),
        ),
        Family(
            "olmo2",
            "Olmo2Config",
            "Olmo2ForCausalLM",
            "allenai/OLMo-2-0425-1B-Instruct",
            "norms after attention and MLP, q/k RMSNorm over all heads; vLLM serves it through "
            "its Transformers backend",
            dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2),
        ),
        # ---- families trained in 2026 (issues 46 and 51)
        Family(
            "gemma4",
            "Gemma4TextConfig",
            "Gemma4ForCausalLM",
            "google/gemma-4-31B-it (its text model)",
            "sliding layers of head_dim 256 and a global layer of head_dim 512 with its own KV "
            "heads, keys doubling as values (attention_k_eq_v), per-layer attributes "
            "(config.per_layer_config), q/k/v RMSNorm, final logit soft-capping, tied",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=256,
                global_head_dim=512,
                num_global_key_value_heads=1,
                attention_k_eq_v=True,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
                final_logit_softcapping=30.0,
                hidden_size_per_layer_input=0,
                tie_word_embeddings=True,
            ),
        ),
        Family(
            "gemma4_e2b",
            "Gemma4TextConfig",
            "Gemma4ForCausalLM",
            "google/gemma-4-E2B-it (its text model)",
            "per-layer input embeddings (PLE), the last layers reusing earlier layers' KV "
            "(num_kv_shared_layers) with double-wide MLPs, sliding head_dim 256 and global "
            "head_dim 512, tied",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=256,
                global_head_dim=512,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"] * 2,
                num_kv_shared_layers=2,
                use_double_wide_mlp=True,
                hidden_size_per_layer_input=64,
                final_logit_softcapping=30.0,
                tie_word_embeddings=True,
            ),
            num_layers=4,
        ),
        Family(
            "gpt_oss",
            "GptOssConfig",
            "GptOssForCausalLM",
            "openai/gpt-oss-20b (unquantised)",
            "attention sinks, sliding (window cut to 16) and full layers, q/k/v/o biases, a "
            "router with a bias and softmax over the chosen experts' logits, clamped SwiGLU "
            "experts with biases, YaRN rope, GQA 4:1",
            dict(
                hidden_size=128,
                intermediate_size=64,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=64,
                num_local_experts=16,
                num_experts_per_tok=4,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=131072,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 4096,
                },
            ),
        ),
        Family(
            "glm4_moe",
            "Glm4MoeConfig",
            "Glm4MoeForCausalLM",
            "zai-org/GLM-4.5-Air",
            "a dense first layer then sparse ones: sigmoid router with a correction bias, "
            "renormalised weights (16 experts, top 4) and a shared expert, q/k/v biases, "
            "partial rotary (half), GQA 4:1",
            dict(
                hidden_size=128,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=64,
                partial_rotary_factor=0.5,
                attention_bias=True,
                n_routed_experts=16,
                num_experts_per_tok=4,
                n_shared_experts=1,
                moe_intermediate_size=64,
                first_k_dense_replace=1,
                norm_topk_prob=True,
                routed_scaling_factor=1.0,
                n_group=1,
                topk_group=1,
            ),
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            "deepseek-ai/DeepSeek-V3",
            "multi-head latent attention (q/kv LoRA ranks, 128 + 64 rope query/key heads, value "
            "heads of 128), a dense first layer, then sigmoid routing over grouped experts (16 "
            "experts in 4 groups, top 2 groups, top 4) with a correction bias and a scaling "
            "factor of 2.5, a shared expert",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                q_lora_rank=64,
                kv_lora_rank=512,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                n_routed_experts=16,
                num_experts_per_tok=4,
                n_group=4,
                topk_group=2,
                routed_scaling_factor=2.5,
                n_shared_experts=1,
                moe_intermediate_size=64,
                first_k_dense_replace=1,
                norm_topk_prob=True,
                # keys of the published config.json that transformers' config class drops and
                # vLLM's loader reads (without them it builds a softmax router with no bias)
                topk_method="noaux_tc",
                scoring_func="sigmoid",
            ),
        ),
        Family(
            "ernie4_5_moe",
            "Ernie4_5_MoeConfig",
            "Ernie4_5_MoeForCausalLM",
            "baidu/ERNIE-4.5-21B-A3B-PT",
            "a dense first layer then sparse ones: softmax router choosing with a correction "
            "bias (moe_statics) and renormalising (16 experts, top 4), two shared experts, GQA "
            "2:1, tied",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=64,
                moe_num_experts=16,
                moe_k=4,
                moe_num_shared_experts=2,
                moe_intermediate_size=64,
                moe_layer_start_index=1,
                tie_word_embeddings=True,
            ),
        ),
        Family(
            "minimax_m2",
            "MiniMaxM2Config",
            "MiniMaxM2ForCausalLM",
            "MiniMaxAI/MiniMax-M2",
            "every layer sparse: sigmoid router with a correction bias and renormalised weights "
            "(16 experts, top 4), q/k RMSNorm over all heads, partial rotary (rotary_dim half "
            "the head), GQA 4:1",
            dict(
                hidden_size=128,
                intermediate_size=64,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=64,
                rotary_dim=32,
                num_local_experts=16,
                num_experts_per_tok=4,
                # keys of the published config.json that transformers' config class does not
                # define and vLLM's MiniMax-M2 model reads
                scoring_func="sigmoid",
                use_routing_bias=True,
                qk_norm_type="per_layer",
            ),
        ),
        Family(
            "lfm2_moe",
            "Lfm2MoeConfig",
            "Lfm2MoeForCausalLM",
            "LiquidAI/LFM2-8B-A1B",
            "short-convolution layers around an attention layer, a dense first layer then sparse "
            "ones with a sigmoid router, an expert bias and renormalised weights (16 experts, "
            "top 4), q/k RMSNorm, tied",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                moe_intermediate_size=64,
                num_experts=16,
                num_experts_per_tok=4,
                num_dense_layers=1,
                layer_types=["conv", "full_attention", "conv"],
                tie_word_embeddings=True,
            ),
            num_layers=3,
        ),
        Family(
            "nemotron_h",
            "NemotronHConfig",
            "NemotronHForCausalLM",
            "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
            "hybrid: Mamba2 layers (heads of 64, 2 groups, state 128), an attention layer and "
            "squared-ReLU MLP layers, each its own block",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=64,
                layers_block_type=["mamba", "mlp", "attention", "mlp"],
                mamba_num_heads=4,
                mamba_head_dim=64,
                n_groups=2,
                ssm_state_size=128,
                chunk_size=128,
            ),
            num_layers=4,
        ),
        Family(
            "nemotron_h_moe",
            "NemotronHConfig",
            "NemotronHForCausalLM",
            "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B",
            "hybrid Mamba2 / attention / MoE blocks: sigmoid routing with a correction bias, "
            "renormalised and scaled weights (16 experts, top 4), squared-ReLU experts without "
            "a gate, a shared expert",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=64,
                layers_block_type=["mamba", "moe", "attention", "moe"],
                mamba_num_heads=4,
                mamba_head_dim=64,
                n_groups=2,
                ssm_state_size=128,
                chunk_size=128,
                n_routed_experts=16,
                num_experts_per_tok=4,
                moe_intermediate_size=64,
                moe_shared_expert_intermediate_size=128,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
            ),
            num_layers=4,
        ),
        Family(
            "granitemoehybrid",
            "GraniteMoeHybridConfig",
            "GraniteMoeHybridForCausalLM",
            "ibm-granite/granite-4.0-h-tiny",
            "hybrid Mamba2 / attention layers without position embeddings, every layer sparse "
            "(softmax over the chosen experts' logits, 16 experts, top 4) with a shared expert, "
            "embedding/attention/residual/logit multipliers",
            dict(
                hidden_size=128,
                intermediate_size=64,
                shared_intermediate_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                layer_types=["mamba", "attention"],
                position_embedding_type="nope",
                mamba_n_heads=4,
                mamba_d_head=64,
                mamba_n_groups=1,
                mamba_d_state=128,
                mamba_chunk_size=128,
                num_local_experts=16,
                num_experts_per_tok=4,
                embedding_multiplier=12.0,
                attention_multiplier=0.015625,
                residual_multiplier=0.22,
                logits_scaling=6.0,
            ),
        ),
        Family(
            "qwen3_next",
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            "Qwen/Qwen3-Next-80B-A3B-Instruct",
            "hybrid gated-delta-net / gated attention (head_dim 256, partial rotary), every "
            "layer sparse (16 experts, top 4) with a gated shared expert",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=256,
                partial_rotary_factor=0.25,
                linear_num_key_heads=1,
                linear_num_value_heads=2,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                layer_types=["linear_attention", "full_attention"],
                num_experts=16,
                num_experts_per_tok=4,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
            ),
        ),
        Family(
            "mistral4",
            "Mistral4Config",
            "Mistral4ForCausalLM",
            "mistralai/Mistral-Small-4-119B-2603 (its text model)",
            "multi-head latent attention and every layer sparse (16 experts, top 4) with a "
            "shared expert; vLLM 0.32 has no implementation of it",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                q_lora_rank=64,
                kv_lora_rank=256,
                qk_nope_head_dim=64,
                qk_rope_head_dim=64,
                v_head_dim=128,
                n_routed_experts=16,
                num_experts_per_tok=4,
                n_shared_experts=1,
                moe_intermediate_size=64,
            ),
        ),
        Family(
            "olmo3",
            "Olmo3Config",
            "Olmo3ForCausalLM",
            "allenai/Olmo-3-7B-Instruct",
            "sliding-window (cut to 16) and full layers, norms after attention and MLP, q/k "
            "RMSNorm over all heads; vLLM serves it through its Transformers backend",
            dict(
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        Family(
            "smollm3",
            "SmolLM3Config",
            "SmolLM3ForCausalLM",
            "HuggingFaceTB/SmolLM3-3B",
            "a layer without rotary embeddings (NoPE, published: every 4th), GQA 4:1, tied; "
            "vLLM serves it through its Transformers backend",
            dict(
                hidden_size=256,
                num_attention_heads=4,
                num_key_value_heads=1,
                no_rope_layers=[1, 0],
                tie_word_embeddings=True,
            ),
        ),
    )
}


# Where MoE blocks keep the correction bias that steers the choice of experts (not their
# weights): DeepSeek-V3, GLM-4.5, MiniMax-M2, Nemotron-H ``e_score_correction_bias`` (ERNIE's
# under ``moe_statics``), LFM2's ``expert_bias``.
CORRECTION_BIASES = ("e_score_correction_bias", "expert_bias")
# A correction bias is drawn with this fraction of the spread of its router's scores over the
# experts: it then changes the chosen set of about two tokens in three (random routers of 16
# experts, top 4, 20 draws: median 64% for softmax scores, range 53-79%; sigmoid 70%, 48-83%),
# as a trained bias does, which exists to move load between experts.
CORRECTION_BIAS_SPREAD = 0.4


def _published_routers(model: torch.nn.Module, initializer_range: float) -> list[str]:
    """Give the model's MoE routers what a published checkpoint's have: random weights where
    transformers initialises them to zeros (ERNIE 4.5's router, whose experts would then tie
    and every token take the first k), and nonzero correction biases (transformers initialises
    them to zeros; a checkpoint's are trained, and an engine that drops one routes otherwise,
    which a zero bias hides). Returns the names of the biases drawn."""
    from fsdp_rlhf.models.moe import moe_routers
    from fsdp_rlhf.models.routers import ROUTER_RULES

    routers = moe_routers(model)
    drawn = []
    with torch.no_grad():
        for router in routers:
            if not router.weight.any():
                router.weight.normal_(0.0, initializer_range)
        # a parameter (ERNIE) or a buffer (the others), saved with the weights either way
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if name.rsplit(".", 1)[-1] not in CORRECTION_BIASES:
                continue
            router = _router_of(model, name, routers)
            logits = torch.randn(256, router.weight.shape[1]) @ router.weight.float().T
            if ROUTER_RULES[type(router).__name__].score == "sigmoid":
                scores = logits.sigmoid()
            else:
                scores = logits.softmax(-1)
            spread = float(scores.std(-1).mean())
            param.copy_(CORRECTION_BIAS_SPREAD * spread * torch.randn_like(param))
            drawn.append(name)
    return drawn


def _router_of(model: torch.nn.Module, name: str, routers: list) -> torch.nn.Module:
    """The router of the MoE block holding the parameter ``name`` (in the router itself,
    ERNIE's in the router's ``moe_statics``, or beside it in the block: MiniMax-M2, LFM2)."""
    names = {id(m): n for n, m in model.named_modules()}
    owners = [r for r in routers if _same_block(names[id(r)], name)]
    if len(owners) != 1:
        raise ValueError(f"{name}: {len(owners)} MoE routers in its block")
    return owners[0]


def _same_block(router: str, param: str) -> bool:
    block = router.rsplit(".", 1)[0]  # the MoE block (mlp, feed_forward, mixer)
    return param.startswith(block + ".")


def _near_tied_routers(model: torch.nn.Module, spread: float) -> None:
    from fsdp_rlhf.models.moe import moe_routers

    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"router_spread: {type(model).__name__} has no MoE router")
    with torch.no_grad():
        for router in routers:
            w = router.weight  # (E, H)
            row = torch.randn(1, w.shape[1]) * w.std()
            w.copy_(row + spread * row.abs().mean() * torch.randn_like(w))


def build_family(
    out_dir: str | Path,
    family: str,
    *,
    num_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    router_spread: float | None = None,
) -> Path:
    """Save a randomly initialised model of ``FAMILIES[family]`` with its tokenizer and a
    generation_config.json to ``out_dir``; returns the path.

    ``router_spread`` (MoE families): every router's (E, H) weight becomes one shared random
    row plus ``router_spread`` x that row's scale in per-expert noise, so the experts' logits
    tie to within a few float32 roundings and the rollout engine and the trainer, which round
    differently, route some tokens to different experts: the near-uniform routers of an
    untrained or collapsed MoE, where router replay matters in fp32 too.

    Every MoE family's routers are random and its correction biases nonzero, as a published
    checkpoint's are (:func:`_published_routers`).
    """
    import transformers

    fam = FAMILIES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    config_cls = getattr(transformers, fam.config_class)
    kwargs = {
        "vocab_size": len(tok),
        "intermediate_size": 4 * fam.config["hidden_size"],
        "num_hidden_layers": fam.num_layers or num_layers,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": None,
        **fam.config,
    }
    if kwargs.get("hidden_size_per_layer_input"):  # Gemma 4's per-layer embeddings: as published,
        kwargs.setdefault("vocab_size_per_layer_input", len(tok))  # one row per token
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model_class)(config_cls(**kwargs))
    if fam.moe:
        _published_routers(model, model.config.get_text_config().initializer_range)
    if router_spread is not None:
        _near_tied_routers(model, router_spread)
    model.save_pretrained(str(out))
    if fam.drop_keys:
        _drop_config_keys(out, fam.drop_keys)
    write_generation_config(out, tok)
    return out
