"""``--float8``: torchao's float8 training (rowwise scaling) for the decoder layers' linears.

torchao swaps each ``nn.Linear`` it is given for a ``Float8Linear`` whose matmuls run in
float8 with one scale per row (``Float8LinearConfig.from_recipe_name("rowwise")``): on H100-class
GPUs the matmuls run at about twice bf16's rate, with master weights, gradients' reduction and
the optimizer unchanged (bf16 / fp32 under FSDP2). torchtitan reports +10-28% tokens/s on 8B
models with it; the GPU ladder's last rung measures it here (``scripts/gpu_mfu_ladder.py``).
The output layer stays bf16 (the log-probs are read from it), as do layers whose sizes float8's
kernels do not take (not multiples of 16). Converted before compiling and sharding.

Where it cannot run the rules table refuses it by name (``float8-*`` rows): torchao not
installed, or not CUDA.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from fsdp_rlhf.distributed.fsdp import decoder_layers


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def _takes(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def use_float8(model: nn.Module) -> int:
    """Convert the linears of ``model``'s decoder layers to torchao's rowwise float8 training;
    returns how many were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("rowwise")
    count = 0
    for layer in decoder_layers(model):
        before = sum(1 for m in layer.modules() if _takes(m))
        convert_to_float8_training(layer, config=config, module_filter_fn=lambda m, _: _takes(m))
        count += before
    return count
