"""LoRA adapters (peft) injected in place into HF models, before FSDP2 sharding.

The model keeps its HF class and module tree; each targeted ``nn.Linear`` becomes a peft
``LoraLayer`` holding the frozen ``base_layer`` and the trainable ``lora_A`` / ``lora_B``.
Parameter names gain segments on the way (``q_proj.weight`` -> ``q_proj.base_layer.weight``,
``q_proj.lora_A.default.weight``); the adapter files peft and vLLM read name the adapter tensors
``base_model.model.<module>.lora_A.weight``. A scalar head (``score`` of reward model and
critic) gets no adapter: it is trained in full and saved with the adapter
(``modules_to_save``), as peft does for sequence classification.

Mixture-of-experts models: adapters go on the attention and the dense parts (a shared expert's
projections, dense MLP layers); the routed experts, the routers and a shared expert's gate stay
frozen and unadapted (``models.moe.never_adapted``). peft 0.21 rewrites the targets of
transformers-5 MoE models as if they named a transformers-4 adapter's modules (its
``convert_peft_config_for_transformers``, for loading such adapters): ``all-linear`` and any
``gate_proj``/``up_proj``/``down_proj`` then land on the fused (E, ...) expert tensors and the
router weight instead of the Linear layers. Fresh adapters are injected without that rewrite.

Vision-language models: the vision tower gets no adapters either; they go on the language model
and the tower stays frozen.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fsdp_rlhf.config import LoraConfig
from fsdp_rlhf.errors import UserError, reading

log = logging.getLogger("fsdp_rlhf")

ADAPTER = "default"  # peft's adapter name inside parameter names; adapter files drop it
PEFT_PREFIX = "base_model.model."
_LORA_SEGMENTS = ("lora_A", "lora_B")
# Wrapper modules that insert a path segment into parameter names: torch.compile and
# activation-checkpoint wrappers. FSDP2 (fully_shard) itself keeps HF names unchanged.
WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def strip_wrappers(name: str) -> str:
    for seg in WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def is_adapter_param(name: str) -> bool:
    """``...q_proj.lora_A.default.weight`` -> True; base and head weights -> False."""
    parts = name.split(".")
    return len(parts) >= 3 and parts[-3] in _LORA_SEGMENTS and parts[-2] == ADAPTER


def adapter_file_name(name: str) -> str:
    """Name of an adapter parameter in peft's ``adapter_model.safetensors`` (what vLLM reads):
    ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    name = strip_wrappers(name)
    if not is_adapter_param(name):
        raise ValueError(f"{name} is not a LoRA adapter parameter")
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def peft_config(
    cfg: LoraConfig,
    head: str | None = None,
    exclude: tuple[str, ...] = (),
    skip_prefix: str | None = None,
):
    """peft's ``LoraConfig`` for ``cfg``; ``head`` (a scalar head), the modules named in
    ``exclude`` and every module under ``skip_prefix`` (a VLM's vision tower) get no
    adapters."""
    from peft import LoraConfig as PeftLoraConfig

    targets = list(cfg.target_modules)
    names = [*exclude, *([head] if head else [])]
    exclude_modules = names or None
    if skip_prefix:  # peft full-matches a string against each module's name
        patterns = [re.escape(skip_prefix) + r"\..*"] + [re.escape(n) for n in names]
        exclude_modules = "|".join(f"(?:{p})" for p in patterns)
    return PeftLoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        exclude_modules=exclude_modules,
        bias="none",
    )


def add_lora(
    model: nn.Module, cfg: LoraConfig, head: str | None = None, *, quiet: bool = False
) -> nn.Module:
    """Inject adapters in place; only they (and ``head``, trained in full) stay trainable.

    Call before ``fully_shard``. Returns ``model`` (same object, same class).
    """
    from peft import inject_adapter_in_model

    from fsdp_rlhf.models.moe import never_adapted
    from fsdp_rlhf.models.vision import vision_prefix

    frozen = tuple(never_adapted(model))
    try:
        with _no_v4_target_rewrite(bool(frozen)):
            inject_adapter_in_model(
                peft_config(cfg, head, frozen, skip_prefix=vision_prefix(model)), model
            )
    except ValueError as e:  # peft: no module matched target_modules
        raise UserError(f"--target_modules {' '.join(cfg.target_modules)}: {e}") from None
    for name, p in model.named_parameters():
        trainable = is_adapter_param(name) or (head is not None and name.startswith(f"{head}."))
        p.requires_grad_(trainable)
    if quiet:
        return model
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA rank %d on %s: %.2fM of %.1fM parameters trained",
        cfg.lora_rank,
        ",".join(target_module_names(model)),
        trained / 1e6,
        total / 1e6,
    )
    return model


@contextmanager
def _no_v4_target_rewrite(active: bool) -> Iterator[None]:
    """peft's rewrite of MoE targets for transformers-4 adapters off (see the module doc)."""
    if not active:
        yield
        return
    from peft.utils import transformers_weight_conversion as conversion

    saved = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = saved


def check_target_modules(path: str, cfg: LoraConfig, trust_remote_code: bool = False) -> None:
    """Preflight: inject into an empty (meta-device) copy of the model at ``path``, so that a
    ``--target_modules`` matching nothing fails in a second, before anything is loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from fsdp_rlhf.models.vision import is_vision_config

    with reading("model config", path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    add_lora(model, cfg, quiet=True)


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module holding an adapter, in model order."""
    from peft.tuners.lora import LoraLayer

    return [(strip_wrappers(n), m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def target_module_names(model: nn.Module) -> list[str]:
    """Short names (``q_proj``, ``down_proj``...) of the modules that hold adapters."""
    return sorted({name.rsplit(".", 1)[-1] for name, _ in lora_modules(model)})


def adapter_config(model: nn.Module, cfg: LoraConfig, base_path: str, head: str | None) -> dict:
    """The ``adapter_config.json`` of this model's adapters (peft's format, also vLLM's). A
    VLM's adapter names its vision tower in ``exclude_modules``: the short target names
    (``up_proj``) also name modules there."""
    from fsdp_rlhf.models.vision import vision_prefix

    tower = vision_prefix(model)
    out = peft_config(cfg, head, skip_prefix=tower).to_dict()
    out.update(
        base_model_name_or_path=base_path,
        target_modules=target_module_names(model),
        exclude_modules=out["exclude_modules"] if tower else None,
        modules_to_save=[head] if head else None,
        task_type="SEQ_CLS" if head else "CAUSAL_LM",
        inference_mode=True,
    )
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in out.items()}


def scaling(cfg: LoraConfig) -> float:
    return cfg.lora_alpha / cfg.lora_rank


def adapter_state_dict(state: dict[str, torch.Tensor], head: str | None) -> dict:
    """The adapter tensors of a full (gathered) state dict, under adapter-file names; the head
    is saved in full as ``base_model.model.<head>.weight`` (peft's modules_to_save)."""
    out = {adapter_file_name(n): t for n, t in state.items() if is_adapter_param(n)}
    if head is not None:
        for n, t in state.items():
            if strip_wrappers(n).startswith(f"{head}."):
                out[PEFT_PREFIX + strip_wrappers(n)] = t
    return out


def merge_lora_state_dict(state: dict[str, torch.Tensor], cfg: LoraConfig) -> dict:
    """Plain HF state dict: ``W + (alpha / r) B @ A`` under each base weight's original name.

    ``state`` is a full state dict of an adapted model (names with ``base_layer`` and
    ``lora_A.default``); merged in fp32, returned in each base weight's dtype.
    """
    state = {strip_wrappers(n): t for n, t in state.items()}
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter_param(name):
            continue
        if ".base_layer." not in name:
            merged[name] = tensor
            continue
        module, leaf = name.rsplit(".base_layer.", 1)
        out = f"{module}.{leaf}"
        a = state.get(f"{module}.lora_A.{ADAPTER}.weight")
        if leaf != "weight" or a is None:
            merged[out] = tensor
            continue
        b = state[f"{module}.lora_B.{ADAPTER}.weight"]
        merged[out] = merged_weight(tensor, a, b, scaling(cfg))
    return merged


def merged_weight(
    base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """``base + scale * lora_b @ lora_a``, computed in fp32, in ``base``'s dtype.

    Shapes: base (out, in), lora_a (r, in), lora_b (out, r)."""
    return (base.float() + scale * (lora_b.float() @ lora_a.float())).to(base.dtype)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` computing with its base weights only (the reference policy of a LoRA actor).

    peft's switch also clears the adapters' ``requires_grad``. The flags are put back at once,
    before the forward: FSDP2 fixes each group's gradient dtypes from them at the model's first
    forward, which for an on-policy actor is this reference forward (with the adapters seen as
    frozen, bf16 gradients would later meet fp32 master weights). A disabled adapter is not
    computed, so its flag does not matter inside.
    """
    layers = [m for _, m in lora_modules(model)]
    flags = {p: p.requires_grad for p in model.parameters()}

    def restore_flags() -> None:
        for p, flag in flags.items():
            p.requires_grad_(flag)

    for m in layers:
        m.enable_adapters(False)
    restore_flags()
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)
        restore_flags()
