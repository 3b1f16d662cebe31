"""Varlen attention kernels: one call per layer over every sequence of a packed row.

A packed row (``models.packing``) or a shared-prompt row (``models.shared_prefix``) holds
several sequences; attention must stay inside each. A varlen kernel takes the queries and keys
of all of them back to back, ``(Tq, H, D)`` and ``(Tk, KV, D)``, with their cumulative offsets
(int32, on the device) and the longest lengths (host ints, computed once per micro-batch before
the first layer), and attends causally within each segment in one launch. Keys and values keep
their KV heads: the kernels share each among its query heads (grouped-query attention) without
a copy. A segment with more keys than queries aligns its causal diagonal bottom-right (the
queries are the segment's last ones), which is what the shared-prefix layouts need; a query
with no key at all gets zeros.

The kernels, in the order they are chosen on CUDA in bf16/fp16:

- flash-attn's ``flash_attn_varlen_func`` when the package is installed;
- torch's own ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, no package needed). Its
  keywords changed between releases, so :func:`torch_varlen_spelling` reads them from its
  signature: causal as ``is_causal=True`` (the first release) or ``window_size=(-1, 0)`` (later,
  which also takes sliding windows); a ``scale`` keyword or none (then the queries are scaled
  beforehand); GQA with unrepeated K/V either implicit or behind ``enable_gqa=True`` (later).

Without one (CPU, fp32, an old torch) the packed attention loops over the sequences
(``models.attention``), which stays the reference. What needs the loop even on CUDA (attention
sinks, a sliding window the kernel cannot take, DPO's shared pair prefixes) is in docs/gpu.md.

Tests and the GPU ladder replace the kernel with :func:`kernel_override` (a CPU reference op,
``fsdp_rlhf.testing.varlen_reference``); the choice is read once per call, so under
``torch.compile`` it is a guarded constant.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# (q (Tq, H, D), k (Tk, KV, D), v (Tk, KV, Dv), cu_q (N+1,) int32, cu_k (N+1,) int32,
#  max_q, max_k, scale, window) -> (Tq, H, Dv); window None: full causal, else each query sees
#  its last ``window`` keys, itself included.
KernelCall = Callable[..., torch.Tensor]

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class VarlenKernel:
    """A varlen attention kernel and what it takes.

    Attributes:
        name: how logs and the ladder name it.
        call: see ``KernelCall``.
        windows: takes a sliding window.
        devices: device types it runs on.
        dtypes: compute dtypes it takes (None: any).
    """

    name: str
    call: KernelCall
    windows: bool
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] | None = _HALF

    def takes(self, q: torch.Tensor, window: int | None) -> bool:
        return (
            q.device.type in self.devices
            and (self.dtypes is None or q.dtype in self.dtypes)
            and (window is None or self.windows)
        )


@dataclass(frozen=True)
class VarlenSpelling:
    """How the installed ``varlen_attn`` is called (read from its signature)."""

    causal: str  # "window_size" or "is_causal"
    scale: bool  # takes ``scale``
    gqa_flag: bool  # needs ``enable_gqa=True`` for fewer KV heads than query heads

    def describe(self) -> str:
        causal = "window_size=(-1, 0)" if self.causal == "window_size" else "is_causal=True"
        gqa = "enable_gqa=True" if self.gqa_flag else "GQA implicit (no flag)"
        scale = "scale=" if self.scale else "no scale keyword (queries pre-scaled)"
        return f"causal as {causal}; {gqa}; {scale}"


def torch_varlen_spelling(fn: Callable) -> VarlenSpelling | None:
    """The keywords of ``varlen_attn`` as this torch spells them, or None when neither causal
    spelling is there (a release this module does not know)."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        causal = "window_size"
    elif "is_causal" in params:
        causal = "is_causal"
    else:
        return None
    return VarlenSpelling(causal, "scale" in params, "enable_gqa" in params)


def torch_varlen_kernel(fn: Callable | None = None) -> VarlenKernel | None:
    """torch's ``varlen_attn`` (or ``fn``, a function with one of its signatures) as a
    :class:`VarlenKernel`; None when this torch has none."""
    if fn is None:
        fn = _import_torch_varlen()
        if fn is None:
            return None
    spelling = torch_varlen_spelling(fn)
    if spelling is None:
        return None

    def call(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
        kwargs = {}
        if spelling.causal == "window_size":
            kwargs["window_size"] = (-1 if window is None else window - 1, 0)
        else:
            kwargs["is_causal"] = True
        if spelling.gqa_flag and k.shape[1] != q.shape[1]:
            kwargs["enable_gqa"] = True
        if spelling.scale:
            kwargs["scale"] = scale
        elif scale is not None and scale != q.shape[-1] ** -0.5:
            q = q * (scale * q.shape[-1] ** 0.5)  # the kernel's own scale is D ** -0.5
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    return VarlenKernel("torch varlen_attn", call, windows=spelling.causal == "window_size")


def _import_torch_varlen() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def flash_attn_kernel() -> VarlenKernel | None:
    """flash-attn's ``flash_attn_varlen_func`` when the package is installed."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # installed but built for another torch or CUDA
        return None

    def call(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
        return flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k,
            softmax_scale=scale, causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
        )  # fmt: skip

    return VarlenKernel("flash-attn flash_attn_varlen_func", call, windows=True)


# Resolved once, outside any compiled region (``resolve_kernels``): traced code only reads them.
_KERNELS: list[VarlenKernel] | None = None
_OVERRIDE: list[VarlenKernel | None] = []


def resolve_kernels() -> list[VarlenKernel]:
    """The installed kernels in order of preference (cached; called at model set-up)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = [k for k in (flash_attn_kernel(), torch_varlen_kernel()) if k is not None]
    return _KERNELS


def select_kernel(q: torch.Tensor, window: int | None = None) -> VarlenKernel | None:
    """The kernel for queries like ``q`` (device, dtype) and ``window``, or None (the loop).
    An override (:func:`kernel_override`) wins where it takes the queries."""
    if _OVERRIDE:
        kernel = _OVERRIDE[-1]
        return kernel if kernel is not None and kernel.takes(q, window) else None
    for kernel in _KERNELS if _KERNELS is not None else resolve_kernels():
        if kernel.takes(q, window):
            return kernel
    return None


@contextmanager
def kernel_override(kernel: VarlenKernel | None) -> Iterator[None]:
    """Use ``kernel`` (None: the per-sequence loop) for packed attention in this block: the
    tests' CPU reference op, or the GPU ladder's baseline rung."""
    _OVERRIDE.append(kernel)
    try:
        yield
    finally:
        _OVERRIDE.pop()


def describe_kernels() -> list[str]:
    """One line per installed kernel, for logs and the ladder."""
    lines = [k.name for k in resolve_kernels()]
    fn = _import_torch_varlen()
    if fn is not None:
        spelling = torch_varlen_spelling(fn)
        sig = f"varlen_attn{inspect.signature(fn)}"
        lines.append(sig if spelling is None else f"{sig}: {spelling.describe()}")
    return lines


@dataclass(frozen=True)
class VarlenSegments:
    """Segments of R model rows laid out for one varlen call, computed once per micro-batch.

    The queries are the rows flattened, ``(R * Lm, H, D)``, cut at ``cu_q``; each segment's
    keys are gathered from the flattened key rows at ``key_index`` (a key row may serve several
    segments: a shared prompt's keys serve each of its responses) and cut at ``cu_k``.

    Attributes:
        cu_q, cu_k: (N + 1,) int32 offsets on the device.
        key_index: (Tk,) int64 row of the flattened keys each gathered key is.
        max_q, max_k: the longest query and key segments (host ints).
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    key_index: torch.Tensor
    max_q: int
    max_k: int


def shared_prompt_segments(
    prompt_lens: torch.Tensor, prompt_lens_host: list[int], P: int, s: int, T: int
) -> VarlenSegments:
    """The varlen layout of G shared-prompt rows ``[prompt | s responses]`` of ``P + s T``
    tokens (``models.shared_prefix``; prompts left-padded to ``P``).

    Per group, ``1 + s`` segments: the prompt (its ``P`` positions as queries, its real tokens
    as keys: a left-padding query sees no key and gets zeros) and each response (its ``T``
    positions as queries, the real prompt tokens then its own ``T`` as keys). Built on the
    device from ``prompt_lens`` (G,), sized by the same lengths on the host: no host sync.
    """
    G = len(prompt_lens_host)
    dev = prompt_lens.device
    Lm = P + s * T
    q_lens = torch.full((G, 1 + s), T, dtype=torch.int64, device=dev)
    q_lens[:, 0] = P
    is_response = (torch.arange(1 + s, device=dev) > 0).long()
    k_lens = prompt_lens.long().view(G, 1) + T * is_response  # (G, 1 + s)
    cu_q = torch.nn.functional.pad(q_lens.flatten().cumsum(0), (1, 0))
    cu_k = torch.nn.functional.pad(k_lens.flatten().cumsum(0), (1, 0))
    total = sum((1 + s) * n + s * T for n in prompt_lens_host)
    slot = torch.arange(total, device=dev)
    seg = torch.searchsorted(cu_k[1:], slot, right=True)  # each key slot's segment
    offset = slot - cu_k[seg]
    g, j = seg // (1 + s), seg % (1 + s)  # j 0: the prompt's segment, j > 0: response j - 1
    plen = prompt_lens.long()[g]
    prompt_key = g * Lm + P - plen + offset
    response_key = g * Lm + P + (j - 1) * T + offset - plen
    key_index = torch.where(offset < plen, prompt_key, response_key)
    max_k = max(prompt_lens_host) + (T if s else 0)
    return VarlenSegments(cu_q.int(), cu_k.int(), key_index, max(P, T), max_k)
