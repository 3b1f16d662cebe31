"""A model's weights under the names and layout of its checkpoint, streamed.

transformers 5 renames and fuses some weights when it loads a checkpoint (its conversion
mapping: Mixtral's and Qwen2/3-MoE's per-expert ``experts.{i}.w1/w3`` or ``gate_proj/up_proj``
become one ``experts.gate_up_proj`` (E, 2I, H); Granite-MoE's ``input_linear`` becomes
``experts.gate_up_proj``; ERNIE's ``moe_statics`` moves under the router ...) and converts them
back when ``save_pretrained`` writes. vLLM's loaders read checkpoints, so the weight sync hands
them what ``save_pretrained`` would write: :class:`CheckpointFormat` applies the model's own
reverse conversion (transformers' ``WeightTransform.reverse_transform``) to a stream of
``(name, tensor)``, a conversion group at a time, so no full state dict is ever held.

Which conversions apply is decided as ``from_pretrained`` decides them: those of the model's
mapping that match the checkpoint's tensor names (read from the safetensors headers), so every
rank streams the checkpoint's own layout whether it loaded the weights or built the model on
the meta device. Without a local checkpoint, the rule ``save_pretrained`` uses for a model it
did not load (every conversion of the mapping but prefix changes) applies.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from copy import deepcopy
from pathlib import Path

import torch
from torch import nn


def checkpoint_keys(path: str | Path) -> list[str] | None:
    """Tensor names of the safetensors checkpoint in folder ``path`` (None: no local one)."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    keys: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            keys += list(st.keys())
    return sorted(keys)


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in the safetensors checkpoint in folder ``path`` (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []:
        with safe_open(str(f), framework="pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


def _conversions(model: nn.Module, keys: list[str] | None) -> list:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    if keys is None:  # as save_pretrained for a model not loaded with from_pretrained
        mapping = get_model_conversion_mapping(model, add_legacy=False)
        return [t for t in mapping if not isinstance(t, PrefixChange)]
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    for key in keys:  # marks the transforms the checkpoint's names use, as loading does
        rename_source_key(key, renamings, converters)
    return [t for t in mapping if t.was_used()]


class CheckpointFormat:
    """The reverse of the conversions ``model`` was loaded with (see the module docstring).

    Built on every rank from the model (FSDP-wrapped or not: only its structure and config
    are read) and the checkpoint folder it came from.
    """

    def __init__(self, model: nn.Module, checkpoint: str | Path | None = None) -> None:
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        keys = checkpoint_keys(checkpoint) if checkpoint is not None else None
        conversions = _conversions(model, keys)
        # as revert_weight_conversion: a sub-model's conversions are undone first
        reverse = [t.reverse_transform() for t in conversions[::-1]]
        self._model = model
        self._checkpoint = checkpoint
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
        self._converters = [t for t in reverse if isinstance(t, WeightConverter)]
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}

    @property
    def identity(self) -> bool:
        """Whether the checkpoint's names are the model's own (nothing to convert)."""
        return not self._renamings and not self._converters

    def convert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, tensor)`` for the model's ``(name, tensor)`` stream. A renamed
        weight is yielded as it comes; a converted one once every tensor its conversion takes
        has come (a fused expert tensor: at once, split into its per-expert tensors, views of
        it). Groups still open at the end (conversions over lists of tensors) are converted
        then."""
        if self.identity:
            yield from weights
            return
        from transformers.core_model_loading import rename_source_key

        pending: dict[str, object] = {}
        for name, tensor in weights:
            renamed, pattern = rename_source_key(
                name, self._renamings, self._converters, reverse=True
            )
            if pattern is None:
                yield renamed, tensor
                continue
            converter = pending.get(renamed)
            if converter is None:
                converter = pending[renamed] = deepcopy(self._by_pattern[pattern])
            converter.add_tensor(renamed, name, pattern, tensor)
            if self._complete(converter):
                del pending[renamed]
                yield from self._realize(renamed, converter)
        for renamed, converter in pending.items():
            yield from self._realize(renamed, converter)

    @staticmethod
    def _complete(converter) -> bool:
        patterns = converter.source_patterns
        return "*" not in "".join(patterns) and set(converter.collected_tensors) >= set(patterns)

    def _checked_transpose(self, renamed: str, converter) -> None:
        """A transpose that checks dims (Qwen3-VL-MoE's fused experts: (E, H, 2I) on disk,
        (E, 2I, H) in transformers) compares the tensor with the model's parameter, which in
        reverse it always equals: it would never transpose back (``save_pretrained`` of such a
        model writes transformers' layout). Here it transposes exactly when the checkpoint
        holds this tensor in the other shape."""
        from transformers.core_model_loading import Transpose

        ops = converter.operations
        if not any(isinstance(op, Transpose) and op.check_dims for op in ops):
            return
        if self._shapes is None:
            self._shapes = checkpoint_shapes(self._checkpoint) if self._checkpoint else {}
        tensors = next(iter(converter.collected_tensors.values()))
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        shape = getattr(tensor, "shape", None)
        if callable(tensor) and shape is None:  # a lazy tensor: materialised by convert
            return
        on_disk = self._shapes.get(renamed)
        if on_disk is None or shape is None or tuple(shape) == on_disk:
            return
        converter.operations = [
            Transpose(op.dim0, op.dim1) if isinstance(op, Transpose) and op.check_dims else op
            for op in ops
        ]

    def _realize(self, renamed: str, converter) -> Iterator[tuple[str, torch.Tensor]]:
        self._checked_transpose(renamed, converter)
        with torch.no_grad():
            out = converter.convert(renamed, model=self._model, config=self._model.config)
        for name, tensor in out.items():
            yield name, tensor[0] if isinstance(tensor, list) else tensor


def checkpoint_format(path: str, trust_remote_code: bool = False) -> CheckpointFormat:
    """The :class:`CheckpointFormat` of the model in folder ``path``, from the model transformers
    builds for its config (on the meta device: nothing is allocated or read but config.json and
    the checkpoint's tensor names)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from fsdp_rlhf.models.vision import is_vision_config

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    return CheckpointFormat(model, path)
