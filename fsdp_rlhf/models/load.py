"""Load tokenizers, causal LMs (actor, reference) and scalar-head models (reward, critic).

A vision-language checkpoint (its config has ``vision_config``) loads as
``AutoModelForImageTextToText``: the same causal-LM contract (``logits``, ``logits_to_keep``,
``get_output_embeddings``) plus the image inputs of ``models.vision``; its vision tower keeps
HF's SDPA (non-causal attention over each image's patches) while the language model gets the
trainer's attention.

Scalar-head models are HF ``*ForSequenceClassification`` models with ``num_labels=1`` and the
head named ``score``: the format ``AutoModelForSequenceClassification`` and vLLM load (a VLM's:
``models.vision_head``, the same layout). Reward
models written by OpenRLHF (head ``value_head``, or any ``--value_head_prefix``) are read too.
Trainable weights are loaded in fp32 (the master copy; bf16 compute comes from FSDP's mixed
precision); frozen ones (ref, reward) may be loaded in bf16 via ``dtype``: they have no master
copy to keep. Loading happens on the host. With ``weights=False`` the same model is built on the
meta device from its config (no memory, nothing read but config.json): the skeleton that
``distributed.rank0_load`` shards and fills from rank 0's copy, so that only rank 0 of a job
holds a full model in host memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

import torch
from torch import nn

from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.errors import UserError, reading
from fsdp_rlhf.models.attention import PADDED_ATTENTION, register_attention
from fsdp_rlhf.models.vision import is_vision_config

log = logging.getLogger(__name__)


def quiet_transformers() -> None:
    """Silence per-load reports and progress bars: one line per model is enough."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def flash_attn_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def attn_implementation(flash_attn: bool, device: torch.device) -> str:
    """``flash_attention_2`` when asked for and possible, else SDPA (with one warning when
    asked for flash): ``models.attention.padded_sdpa``, which is SDPA except for CPU training."""
    if flash_attn and flash_attn_available(device):
        return "flash_attention_2"
    if flash_attn:
        log.warning("--flash_attn: flash-attn or CUDA not available here, using sdpa attention")
    register_attention()
    return PADDED_ATTENTION


def check_model_path(path: str, flag: str) -> None:
    """Fail early, naming the flag, when a local model folder is missing or not a model, or
    when one of its safetensors files is cut short or its index names a missing file
    (:func:`safetensors_problem`: headers only, no weights are read)."""
    if not path:
        raise UserError(f"{flag} is required")
    p = Path(path)
    looks_local = p.is_absolute() or path.startswith(".") or p.exists() or path.count("/") != 1
    if looks_local and not (p / "config.json").is_file():
        what = "does not exist" if not p.exists() else "has no config.json"
        raise UserError(f"{flag} {path}: {what}")
    if looks_local:
        _check_model_type(p / "config.json", path, flag)
        problem = safetensors_problem(p)
        if problem:
            raise UserError(f"{flag} {path}: {problem}")


def _check_model_type(config_file: Path, path: str, flag: str) -> None:
    """A model type the installed transformers does not know (a family newer than it, such as
    LFM3 under transformers 5.19) is refused in one line naming the architecture."""
    import transformers

    with reading("model config", config_file):
        config = json.loads(config_file.read_text())
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not model_type or "auto_map" in config or model_type in transformers.CONFIG_MAPPING:
        return
    arch = ",".join(config.get("architectures") or []) or model_type
    raise UserError(
        f"{flag} {path}: the architecture {arch} (model type '{model_type}') is not in "
        f"transformers {transformers.__version__}: neither the trainer nor vLLM's Transformers "
        "backend can build it (a transformers release that has it, or --trust_remote_code for a "
        "model that ships its own code)"
    )


def safetensors_problem(folder: Path) -> str | None:
    """Why a model folder's safetensors files cannot be loaded, from their headers (the first
    8 bytes give the JSON header's length; its ``data_offsets`` say where the tensors end):
    a file shorter than its header says (a cut-off copy or download), a header that is not
    JSON, or a file the index names that is not there. None when they look whole."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, ValueError) as e:
            return f"{index.name} cannot be read ({e})"
        for name in sorted(set(weight_map.values())):
            if not (folder / name).is_file():
                return f"{index.name} names {name}, which is not in the folder"
    for f in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_file_problem(f)
        if problem:
            return f"{f.name} {problem}; copy or download it again"
    return None


def _safetensors_file_problem(f: Path) -> str | None:
    size = f.stat().st_size
    if size < 8:
        return f"is cut short ({size} bytes: not even its header's length)"
    with f.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > size - 8:
            return f"is cut short: its header alone should be {n} bytes, the file has {size}"
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, ValueError):
            return "is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "is not a safetensors file (its header is not a JSON object)"
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets", ())) == 2
    ]
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"is cut short: its header puts the tensors' end at byte {need}, the file has {size}"
    return None


def text_config(path: str, trust_remote_code: bool = False):
    """The text decoder's config of a model folder (or hub name), without loading weights."""
    from transformers import AutoConfig

    quiet_transformers()
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return cfg.get_text_config()


def model_context(path: str, trust_remote_code: bool = False) -> int | None:
    """The tokens a model at ``path`` takes (``max_position_embeddings``, times the RoPE
    factor of an extended context: vLLM allows at most that); None when its config says not."""
    text = text_config(path, trust_remote_code)
    context = getattr(text, "max_position_embeddings", None)
    if not context:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind not in (None, "default") and rope.get("factor"):
        context = int(context * float(rope["factor"]))
    return context


def check_expert_parallel(
    n: int,
    world_size: int,
    paths: dict[str, str | None],
    trust_remote_code: bool = False,
    ranks: str = "the world size",
) -> None:
    """``--expert_parallel_size n`` against the world and each MoE model's experts (``paths``:
    flag -> model folder; dense models are left as they are), before anything loads: one line
    naming the numbers. Each MoE model is built empty on the meta device to check that its
    fused experts are a layout the expert-parallel forward handles. Which models expert
    parallelism combines with (no MoE model at all) is the rules table's (``fsdp_rlhf.rules``,
    rows ``expert-parallel-*``). ``ranks``: what
    ``world_size`` counts, for the error line (asynchronous training: the training ranks)."""
    if n == 1:
        return
    from fsdp_rlhf.distributed.expert_parallel import (
        expert_parallel_problem,
        routed_experts,
        unsupported_experts,
    )
    from fsdp_rlhf.hf_config import config_num_experts

    if world_size % n:
        raise UserError(
            f"--expert_parallel_size {n} must divide {ranks} {world_size} "
            "(torchrun --nproc_per_node x --nnodes"
            + (", less the rollout ranks)" if ranks != "the world size" else ")")
        )
    for flag, path in paths.items():
        if not path:
            continue
        check_model_path(path, flag)
        num_experts = config_num_experts(text_config(path, trust_remote_code))
        if not num_experts:
            continue  # a dense model beside an MoE actor: sharded as without the flag
        if problem := expert_parallel_problem(n, world_size, num_experts):
            raise UserError(f"{problem} ({flag} {path})")
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        auto = AutoModelForCausalLM
        if is_vision_language(path, trust_remote_code):  # its language model's experts
            auto = AutoModelForImageTextToText
        with torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=trust_remote_code)
        odd = [p for m in routed_experts(model) if (p := unsupported_experts(m))]
        if odd:
            raise UserError(
                f"--expert_parallel_size {n}: {flag} {path}: its fused experts {odd[0]} are not "
                "a layout expert parallelism splits (gate_up_proj and down_proj, no biases; "
                "use 1)"
            )


def load_tokenizer(
    path: str, backend: BackendConfig | None = None, chat_template: str | None = None
):
    """The model's tokenizer (the Rust one unless ``--disable_fast_tokenizer``), with a pad
    token, and ``chat_template`` (``--tokenizer_chat_template``) in place of its own."""
    from transformers import AutoTokenizer

    backend = backend or BackendConfig()
    with reading("tokenizer", path):
        tok = AutoTokenizer.from_pretrained(
            path,
            trust_remote_code=backend.trust_remote_code,
            use_fast=not backend.disable_fast_tokenizer,
        )
    if chat_template is not None:
        tok.chat_template = chat_template
    if tok.pad_token_id is None:
        # Llama-style tokenizers ship without a pad token; eos is the common stand-in.
        tok.pad_token = tok.eos_token
    return tok


def is_vision_language(path: str, trust_remote_code: bool = False) -> bool:
    """Whether ``path`` (a local folder or hub name) holds a vision-language model."""
    from transformers import AutoConfig

    with reading("model config", path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return is_vision_config(config)


def _from_config(auto_cls, path: str, dtype: torch.dtype, attn, trust: bool, **config_kw):
    """``auto_cls``'s model (an Auto class or a model class) for ``path`` on the meta device:
    shapes, names and ties as ``from_pretrained`` builds them, no storage."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust, **config_kw)
    with torch.device("meta"):
        if hasattr(auto_cls, "from_config"):
            model = auto_cls.from_config(
                config, dtype=dtype, attn_implementation=attn, trust_remote_code=trust
            )
        else:  # a model class (models.vision_head)
            model = auto_cls._from_config(config, dtype=dtype, attn_implementation=attn)
    if model.can_generate():  # as from_pretrained: the checkpoint's, which an export writes
        with contextlib.suppress(OSError):  # none in the folder: the config's defaults stay
            model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def load_causal_lm(
    path: str,
    backend: BackendConfig,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    weights: bool = True,
) -> nn.Module:
    """Load on the host in ``dtype`` (``weights=False``: the meta-device skeleton); ``device``
    only picks the attention implementation. A vision-language model loads whole (vision tower
    included) as ``AutoModelForImageTextToText``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    quiet_transformers()
    attn = attn_implementation(backend.flash_attn, device)
    trust = backend.trust_remote_code
    auto, what, impl = AutoModelForCausalLM, "causal LM", attn
    if is_vision_language(path, trust):
        auto, what, impl = AutoModelForImageTextToText, "vision-language model", _vlm_attn(attn)
    with reading(what, path):
        if weights:
            model = auto.from_pretrained(
                path, dtype=dtype, attn_implementation=impl, trust_remote_code=trust
            )
        else:
            model = _from_config(auto, path, dtype, impl, trust)
    model.config.use_cache = False
    enable_checkpointing(model, backend)
    return model


def enable_checkpointing(model: nn.Module, backend: BackendConfig) -> None:
    """``--gradient_checkpointing`` with its ``--gradient_checkpointing_policy``
    (``models.checkpointing``): transformers' full recompute, or selective checkpointing of the
    decoder layers (a VLM's vision blocks keep the full recompute)."""
    if not backend.gradient_checkpointing:
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if backend.gradient_checkpointing_policy == "selective":
        from fsdp_rlhf.models.checkpointing import use_selective_checkpointing

        use_selective_checkpointing(model)


def _vlm_attn(attn: str) -> dict[str, str]:
    """A VLM's attention per part: the trainer's in the language model; the vision tower
    attends over each image's patches without a causal mask (HF's SDPA or flash-attn)."""
    tower = "flash_attention_2" if attn == "flash_attention_2" else "sdpa"
    return {"text_config": attn, "vision_config": tower}


def _read_head_weight(path: Path, prefix: str) -> torch.Tensor | None:
    """Find ``<prefix>.weight`` in a local checkpoint's safetensors files."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if f"{prefix}.weight" in st.keys():  # noqa: SIM118 - safe_open has no __contains__
                return st.get_tensor(f"{prefix}.weight")
    return None


def load_scalar_model(
    path: str,
    backend: BackendConfig,
    device: torch.device,
    *,
    value_head_prefix: str = "score",
    init_head_if_missing: bool = True,
    dtype: torch.dtype = torch.float32,
    weights: bool = True,
) -> nn.Module:
    """A ``*ForSequenceClassification`` model with one output, head named ``score``
    (``weights=False``: the meta-device skeleton). A vision-language checkpoint (causal, or a
    scalar model saved before) loads as :func:`~fsdp_rlhf.models.vision_head.vision_scalar_class`
    builds it: the head on the language model, the vision tower kept.

    The head comes from the checkpoint's ``score.weight``, else ``<value_head_prefix>.weight``
    (OpenRLHF layout), else it is initialised N(0, 1/(H+1)) when ``init_head_if_missing``.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from fsdp_rlhf.models.vision_head import vision_scalar_class

    quiet_transformers()
    attn = attn_implementation(backend.flash_attn, device)
    trust = backend.trust_remote_code
    auto, what, impl = AutoModelForSequenceClassification, "scalar-head model", attn
    if is_vision_language(path, trust):
        with reading("model config", path):
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        auto, impl = vision_scalar_class(config), _vlm_attn(attn)
        what = "vision-language scalar-head model"
    info = {"missing_keys": []}
    with reading(what, path):
        if weights:
            model, info = auto.from_pretrained(
                path,
                num_labels=1,
                dtype=dtype,
                attn_implementation=impl,
                trust_remote_code=trust,
                output_loading_info=True,
            )
        else:
            model = _from_config(auto, path, dtype, impl, trust, num_labels=1)
    if "score.weight" in info["missing_keys"]:
        weight = _read_head_weight(Path(path), value_head_prefix) if Path(path).is_dir() else None
        with torch.no_grad():
            if weight is not None:
                model.score.weight.copy_(weight.reshape_as(model.score.weight))
            elif init_head_if_missing:
                hidden = model.config.get_text_config().hidden_size
                model.score.weight.normal_(0.0, 1.0 / (hidden + 1))
            else:
                names = sorted({"score", value_head_prefix})
                raise UserError(f"{path}: no value head ({' or '.join(names)}) found")
    model.config.use_cache = False
    text = model.config.get_text_config()  # the config itself for a text model
    if text.pad_token_id is None:
        text.pad_token_id = text.eos_token_id
    enable_checkpointing(model, backend)
    return model


def reward_normalization(path: str) -> tuple[float, float] | None:
    """The (mean, std) a reward-model trainer stored in config.json, if any."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return None
    with reading("config", cfg_file):
        cfg = json.loads(cfg_file.read_text())
    mean, std = cfg.get("reward_mean", cfg.get("mean")), cfg.get("reward_std", cfg.get("std"))
    if mean is None or std is None or not math.isfinite(std) or std <= 0:
        return None
    return float(mean), float(std)
