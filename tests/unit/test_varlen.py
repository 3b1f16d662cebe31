"""One varlen attention call per layer (models.varlen, issue #58), proven on CPU: the CUDA
kernel replaced by the CPU reference op (fsdp_rlhf.testing.varlen_reference), a Qwen2 of
Qwen2.5-1.5B's head layout (12 query / 2 KV heads, no head_dim key).

- packed rows: one kernel call per layer per pass whatever the number of sequences, K/V
  unrepeated, int32 offsets on the device; log-probs and gradients equal the per-sequence loop;
- dispatched ops per layer bounded and the same for 2 and 8 sequences;
- no host sync inside the model, forward and backward (and the loop does sync: the check bites);
- one decoder layer traces whole (torch._dynamo.explain: 0 graph breaks), selectively
  checkpointed too;
- GRPO's shared-prompt rows as varlen segments equal the masked path;
- varlen_attn's spellings across torch releases.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_rlhf.models import varlen
from fsdp_rlhf.models.attention import PADDED_ATTENTION, register_attention, use_varlen_attention
from fsdp_rlhf.models.forward import response_logprobs
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.models.varlen import kernel_override, shared_prompt_segments
from fsdp_rlhf.testing.syncs import HostSyncError, no_host_syncs
from fsdp_rlhf.testing.varlen_reference import reference_kernel

LAYERS, T = 2, 6  # decoder layers; response tokens per row


@pytest.fixture(scope="module")
def qwen2():
    """Qwen2.5-1.5B's attention layout scaled down: 12 query heads, 2 KV heads (ratio 6),
    head size from hidden / heads (its config has no head_dim)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    register_attention()
    config = Qwen2Config(
        vocab_size=300, hidden_size=384, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    assert "head_dim" not in config.to_diff_dict()
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(config, attn_implementation=PADDED_ATTENTION)


def _packed_batch(n: int, seed: int = 0):
    """``n`` sequences of 8-14 tokens, left- and right-padded to 16."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 300, (n, 16), generator=g)
    mask = torch.zeros(n, 16, dtype=torch.long)
    for i in range(n):
        length = int(torch.randint(8, 15, (1,), generator=g))
        start = 0 if i % 2 else 16 - length  # left- and right-padded rows
        mask[i, start : start + length] = 1
    return ids, mask


def _shared_batch():
    """2 groups of 3 rows sharing left-padded prompts (P 10), right-padded responses (T)."""
    g = torch.Generator().manual_seed(1)
    P, s = 10, 3
    ids = torch.randint(1, 300, (2 * s, P + T), generator=g)
    mask = torch.ones(2 * s, P + T, dtype=torch.long)
    for grp, pad in enumerate((3, 0)):
        rows = slice(grp * s, (grp + 1) * s)
        ids[rows, :P] = ids[grp * s, :P]
        mask[rows, :pad] = 0
    mask[1, -2:] = 0
    mask[4, -4:] = 0
    return ids, mask, s


def _run(model, ids, mask, *, packed: bool, group: int = 1, kernel=None, guard=False):
    """Log-probs (B, T) and grads of a forward + backward, under ``kernel`` (None: the loop)
    and, with ``guard``, with host syncs failing inside the model and its backward."""
    model = copy.deepcopy(model)
    if packed:
        use_varlen_attention(model, "cpu")
    with kernel_override(kernel):
        inputs = forward_inputs(ids, mask, packed=packed, group_size=group, response_len=T)
        if guard:
            real = model.forward

            def guarded(*args, **kwargs):
                with no_host_syncs():
                    return real(*args, **kwargs)

            model.forward = guarded
        lp, _ = response_logprobs(model, inputs, T)
        loss = (lp * mask[:, -T:] * torch.arange(1.0, T + 1)).sum()
        with no_host_syncs() if guard else torch.enable_grad():
            loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return lp, grads


def _assert_equal(a, b, mask):
    on = mask[:, -T:].bool()
    torch.testing.assert_close(a[0][on], b[0][on], rtol=1e-5, atol=1e-5)
    assert a[1].keys() == b[1].keys() and a[1]
    for name, g in a[1].items():
        torch.testing.assert_close(g, b[1][name], rtol=1e-4, atol=1e-5, msg=name)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n", [2, 8])
def test_packed_rows_one_kernel_call_per_layer_equal_to_the_loop(qwen2, n):
    ids, mask = _packed_batch(n)
    calls: list = []
    with _OpCounter() as ops:
        got = _run(qwen2, ids, mask, packed=True, kernel=reference_kernel(calls))
    assert len(calls) == LAYERS  # one call per layer in forward, whatever n
    backward = [o for o in ops.ops if o.endswith("varlen_attention_reference_backward")]
    assert len(backward) == LAYERS  # and one in backward
    for q, k, v, cu_q, cu_k, max_q, max_k in calls:
        assert q.shape[1] == 12 and k.shape[1] == v.shape[1] == 2  # K/V not repeated
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == q.device
        assert cu_q.numel() == n + 1 and isinstance(max_q, int)
        assert max_q == max_k == int(mask.sum(-1).max())
    _assert_equal(got, _run(qwen2, ids, mask, packed=True), mask)


def _layer_ops(model, ids, mask, kernel) -> tuple[int, int]:
    """Ops dispatched inside decoder layer 0's forward, and in the whole forward + backward."""
    model = copy.deepcopy(model)
    use_varlen_attention(model, "cpu")
    layer = model.model.layers[0]
    counter = _OpCounter()
    marks = []
    h1 = layer.register_forward_pre_hook(lambda *_: marks.append(len(counter.ops)))
    h2 = layer.register_forward_hook(lambda *_: marks.append(len(counter.ops)))
    with kernel_override(kernel):
        inputs = forward_inputs(ids, mask, packed=True, response_len=T)
        with counter:
            lp, _ = response_logprobs(model, inputs, T)
            lp.sum().backward()
    h1.remove(), h2.remove()
    return marks[1] - marks[0], len(counter.ops)


def test_dispatched_ops_per_layer_bounded_and_independent_of_the_sequences(qwen2):
    kernel = reference_kernel()
    (layer2, total2), (layer8, total8) = (
        _layer_ops(qwen2, *_packed_batch(n), kernel) for n in (2, 8)
    )
    assert layer2 == layer8 and total2 == total8
    # norms, q/k/v/o, rotary, the kernel, SwiGLU, residuals: 77 ops in eager (transformers
    # 5.19); the loop takes 106 for 2 sequences and 154 for 8
    assert layer2 <= 100, layer2
    # the loop grows with the number of sequences: what the kernel removes
    loop2, loop8 = (_layer_ops(qwen2, *_packed_batch(n), None)[0] for n in (2, 8))
    assert loop8 > loop2 > layer2


@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_no_host_sync_inside_the_model(qwen2, layout):
    if layout == "packed":
        ids, mask = _packed_batch(4)
        kw = dict(packed=True)
    else:
        ids, mask, s = _shared_batch()
        kw = dict(packed=False, group=s)
    _run(qwen2, ids, mask, kernel=reference_kernel(), guard=True, **kw)
    if layout == "packed":  # the per-sequence loop reads its offsets: the guard catches it
        with pytest.raises(HostSyncError):
            _run(qwen2, ids, mask, guard=True, **kw)


def test_one_decoder_layer_traces_whole(qwen2):
    """torch._dynamo.explain on one layer's forward with a packed row's inputs (and the
    shared-prompt rows', and selectively checkpointed): one graph, no break."""
    from fsdp_rlhf.models.checkpointing import use_selective_checkpointing

    cases = {
        "packed": (True, 1, *_packed_batch(3)),
        "shared": (False, 3, *_shared_batch()[:2]),
    }
    for name, (packed, group, ids, mask) in cases.items():
        for selective in (False, True):
            model = copy.deepcopy(qwen2)
            if packed:
                use_varlen_attention(model, "cpu")
            if selective:
                use_selective_checkpointing(model)
                model.train()
            layer, seen = model.model.layers[0], {}
            hook = layer.register_forward_pre_hook(
                lambda _m, a, k, seen=seen: seen.update(args=a, kwargs=k), with_kwargs=True
            )
            with kernel_override(reference_kernel()):
                inputs = forward_inputs(ids, mask, packed=packed, group_size=group, response_len=T)
                with torch.no_grad():
                    model(**inputs.kwargs)
                hook.remove()
                hidden = seen["args"][0].detach().requires_grad_()
                explained = torch._dynamo.explain(layer.forward)(
                    hidden, *seen["args"][1:], **seen["kwargs"]
                )
            assert explained.graph_break_count == 0, (name, selective, explained.break_reasons)
            assert explained.graph_count == 1


def test_shared_prompt_rows_as_varlen_segments_equal_the_masked_path(qwen2):
    ids, mask, s = _shared_batch()
    calls: list = []
    got = _run(qwen2, ids, mask, packed=False, group=s, kernel=reference_kernel(calls))
    assert len(calls) == LAYERS and calls[0][1].shape[1] == 2
    _assert_equal(got, _run(qwen2, ids, mask, packed=False, group=s), mask)


def test_shared_prompt_segments_layout():
    """Group 0: prompt of 2 real tokens after 1 pad (P 3), 2 responses of T 2; group 1: 3."""
    seg = shared_prompt_segments(torch.tensor([2, 3]), [2, 3], P=3, s=2, T=2)
    assert seg.cu_q.tolist() == [0, 3, 5, 7, 10, 12, 14]  # rows of 3 + 2 x 2 = 7 tokens
    assert seg.cu_k.tolist() == [0, 2, 6, 10, 13, 18, 23]
    assert seg.key_index.tolist() == [
        1, 2,  1, 2, 3, 4,  1, 2, 5, 6,  # group 0: prompt keys skip the pad (row position 0)
        7, 8, 9,  7, 8, 9, 10, 11,  7, 8, 9, 12, 13,
    ]  # fmt: skip
    assert (seg.max_q, seg.max_k) == (3, 5)
    assert seg.cu_q.dtype == seg.cu_k.dtype == torch.int32


def _fake(params: str):
    """A function with ``varlen_attn``'s signature of one torch release, recording its call."""
    seen = {}
    src = f"def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k{params}): pass"
    namespace: dict = {}
    exec(src, namespace)  # noqa: S102 - a signature under test, built from literals

    def fn(*args, **kwargs):
        seen.update(kwargs=kwargs, q=args[0])
        return args[0]

    fn.__signature__ = inspect.signature(namespace["varlen_attn"])
    return fn, seen


@pytest.mark.parametrize(
    "params,expected",
    [
        # torch 2.10: causal as a flag, no scale, GQA implicit
        (", is_causal=False, return_aux=None", {"is_causal": True}),
        # then window_size and scale, GQA still implicit
        (", *, return_aux=None, scale=None, window_size=(-1, -1)",
         {"window_size": (-1, 0), "scale": 0.5}),
        # torch 2.13: enable_gqa required for fewer KV heads
        (", *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False",
         {"window_size": (-1, 0), "scale": 0.5, "enable_gqa": True}),
    ],
)  # fmt: skip
def test_varlen_attn_spellings(params, expected):
    fn, seen = _fake(params)
    kernel = varlen.torch_varlen_kernel(fn)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    kernel.call(q, k, k, cu, cu, 5, 5, 0.5, None)
    assert seen["kwargs"] == expected
    if "scale" not in params:  # no scale keyword: the queries carry 0.5 / 16 ** -0.5
        torch.testing.assert_close(seen["q"], q * (0.5 * 4.0))
    assert kernel.windows == ("window_size" in params)


def test_installed_varlen_attn_is_recognised_and_chosen_only_where_it_runs():
    fn = varlen._import_torch_varlen()
    if fn is not None:  # torch >= 2.10
        assert varlen.torch_varlen_spelling(fn) is not None
    cpu = torch.empty(1, dtype=torch.bfloat16)
    assert varlen.select_kernel(cpu) is None  # CUDA-only kernels: the loop on CPU
    ref = reference_kernel()
    with kernel_override(ref):
        assert varlen.select_kernel(cpu) is ref
        with kernel_override(None):
            assert varlen.select_kernel(cpu) is None


def test_the_installed_varlen_attn_takes_our_call():
    """This torch's own ``varlen_attn`` (its fake kernels, on meta tensors: no GPU here) takes
    the adapter's call, K/V with 2 heads for 12 query heads and the queries a transposed view,
    as ``varlen_sdpa`` passes them, forward and backward."""
    kernel = varlen.torch_varlen_kernel()
    if kernel is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.randn(12, 10, 128, **meta).transpose(0, 1).requires_grad_()
    k, v = (torch.randn(10, 2, 128, **meta, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")
    out = kernel.call(q, k, v, cu, cu, 6, 6, None, None)
    assert out.shape == (10, 12, 128)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == (10, 2, 128)
