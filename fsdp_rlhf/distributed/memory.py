"""Per-device memory model of a colocated PPO job, phase by phase (pure arithmetic, no GPU).

Every rank holds FSDP2 shards of actor, critic, reference and reward models plus a vLLM engine.
The phases of one step do not overlap, so the job fits when each phase does:

* ``start-up / wake``: vLLM insists on ``free >= util x total`` when it starts, and its sleep
  mode re-creates the same pool on every wake (``CuMemAllocator.wake_up``), beside whatever the
  trainer holds then, so ``resident + util x total <= total`` must hold with ``resident`` =
  everything the trainer keeps on the device during rollout, plus the caching allocator's slack
  on those tensors (``ALLOCATOR_SLACK``). ``util`` is a fraction of the *whole* device: the
  pool is as large at wake as at start-up, whatever else is resident by then.
* ``rollout``: vLLM's pool (weights + KV cache + CUDA graphs + activations, ``util x total``) +
  resident shards + the weight-sync gather buckets + CUDA context/NCCL.
* ``scoring``: no-grad forwards (ref, reward, critic values, old log-probs) at
  ``micro_rollout_batch_size``, one model at a time: the larger of a policy pass (the scored
  model's shard when offloaded, one gathered layer, the logits) and the critic's pass (its fp32
  shard, onloaded for its values and kept until its update, and one gathered layer).
* ``actor update`` / ``critic update``: sharded fp32 params, grads and Adam moments (on the host
  with ``--adam_offload``: FSDP's CPUOffloadPolicy), gathered bf16 layers, activations, logits,
  the unsharded gradients of the largest FSDP group and its fp32 reduce-scatter input (the root:
  embeddings + LM head, reduced last), plus frozen shards that stay (no ``--ref_reward_offload``),
  the actor's EMA (``--enable_ema`` without an offload flag) and what vLLM keeps asleep (buffers
  and, unless ``--enforce_eager``, its CUDA-graph pool). The critic's update also holds the
  actor's fp32 shard: the actor's params never leave the device (only its Adam state does).

What stays on the device between phases is what the trainer leaves there: the actor's fp32
shard always; its Adam state from its update until the engine's next wake (it comes back only
for the actor's update, so neither scoring nor the critic's update holds it); the critic, with
its Adam state, from its values pass through its update; the frozen shards unless
``--ref_reward_offload``. Grads are dropped after every optimizer step (``set_to_none``).

Bytes per element: fp32 master params/grads 4, Adam 2 x 4, bf16 compute copies 2. Shapes:
``b`` micro-batch, ``s = prompt_max_len + generate_max_len``, ``h`` hidden, ``I`` MLP width,
``V`` vocab, ``L`` layers, ``N`` parameters, ``W`` ranks; the root holds ``V h`` embedding
values once with tied embeddings, twice without. Activations per layer and token are
about ``9 h + 3 I`` bf16 values (norm in/out, q/k/v, attention out, o_proj, residual; SwiGLU gate,
up and product), flash/SDPA attention keeping no ``s x s`` matrix; with gradient checkpointing
only each layer's input (``h`` values) is kept, plus one layer recomputed in backward; with
``--gradient_checkpointing_policy selective`` also the outputs of its matmuls and attention
(``5 h + 2 kv + 2 I`` values with the input), the elementwise rest recomputed.
ZeRO-3 with ``--accumulate_gathered`` (chosen here under ``auto``: :func:`gathered_update_fits`)
holds the update's params and grads as below ZeRO-3: every layer gathered and the grads
unsharded until the optimizer step's last micro-batch.
Attention masks: SDPA keeps an explicit mask for backward as a bias in the compute dtype, one
per layer (one, the recomputed layer's, with gradient checkpointing), and a sequence-parallel
rank keeps it whole (the attention inside Ulysses runs whole rows): :func:`attention_mask_bytes`
counts the layouts that still pass one (padded rows without sequence parallelism, shared-prompt
rows); packed rows, flash-attn and Ulysses' padded rows use causal kernels and keep none.
Logits: only the ``T`` positions that predict a response token (``logits_to_keep``), ``b T V``
values in the compute dtype, counted as kept with their gradient in the update, and read in fp32
chunks of ``CHUNK_ELEMENTS``. Since issue #45 (finding 9) the trainer computes the log-probs
inside the output layer from its input (models.head: vocabulary blocks, no logits made) unless
the model post-processes its logits, so for most models this term is an over-estimate.
With ``--sequence_parallel_size N`` (Ulysses) each rank holds ``ceil(s / N)`` tokens of every
sequence: activations and logits per rank divide by N, plus one layer's all-to-all buffers
(q, k, v and the attention output, exchanged and received: ``4 b s/N (h + 2 kv)`` values); the
micro-batch ``b`` is per sequence-parallel group. :func:`sequence_parallel_needed` finds the
smallest N that makes every phase fit.
With ``--expert_parallel_size E`` (an MoE model's routed experts split over groups of E ranks)
the shards stay ``1 / W`` of every weight, but what a forward gathers changes: each MoE layer's
unit holds ``X / L`` expert values (``X`` routed expert parameters in all) of which a rank
gathers ``X / (L E)`` (its group's experts, from the ``W / E`` ranks holding them), so gathered
layers, ZeRO<3's whole gathered model and its unsharded gradients count ``X / E`` instead of
``X``; one layer's token exchange adds its all-to-all buffers, the rows sent to the experts and
received back in both directions, ``4 b s/N k h`` values (``k`` experts per token).
:func:`~fsdp_rlhf.distributed.memory_plan.expert_parallel_fit` finds the smallest E that
makes every phase fit. vLLM's engine holds every expert (docs/models.md#expert-parallelism).
With ``--rollout_engine hf`` there is no vLLM pool: the engine is an unsharded copy of the actor
in the compute dtype, resident in every phase. Its rollout adds the larger of the weight sync
(:func:`hf_sync_bytes`) and generation (:func:`hf_generation`: the KV cache, every step's fp32
scores, a step's temporaries, one prefill layer), since the sync ends before generation starts.
With delta weight sync (``--weight_sync delta``) every engine rank keeps a copy of the synced
weights in the engine dtype in host memory (``distributed.delta_sync``: the mirror, ``N`` values
per rank, resident in every phase): counted where host memory is the device (CPU jobs,
``sync_mirror``); on CUDA it is host memory beside the job, not in these phases (``auto`` uses
full syncs on colocated CUDA jobs).
Constants marked ASSUMED are not measured yet; the GPU suite (``tests/gpu``) prints the measured
phase peaks beside this model's estimate, and what the device holds by owner at each phase's
end (``distributed.memory_census``), to calibrate them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fsdp_rlhf.algorithms.logprobs import CHUNK_ELEMENTS
from fsdp_rlhf.hf_config import attention_layers, head_dim

GIB = 2**30
CONTEXT_BYTES = int(1.5 * GIB)  # ASSUMED: CUDA context + NCCL buffers per process
VLLM_ASLEEP_BYTES = 1 * GIB  # ASSUMED: what a sleeping vLLM keeps (buffers, NCCL, workspaces)
VLLM_CUDA_GRAPH_BYTES = 1 * GIB  # ASSUMED: its CUDA-graph pool, kept asleep (not --enforce_eager)
VLLM_MIN_KV_BYTES = 1 * GIB  # ASSUMED: a pool smaller than the weights + this holds too few tokens
SYNC_BUCKET_BYTES = 256 << 20  # fsdp.GATHER_BUCKET_BYTES["cuda"]; two live at once
LOGPROB_CHUNK_BYTES = 4 * 4 * CHUNK_ELEMENTS  # fp32 temporaries of one log-prob chunk (<= 4)
TRAIN_HEADROOM = 0.95  # fragmentation of the caching allocator
# ASSUMED: reserved beyond allocated, as a fraction of the trainer's tensors resident at wake
# and rollout (vLLM's pool is mapped outside the caching allocator)
ALLOCATOR_SLACK = 0.05


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on. ``params`` counts every parameter (N); ``embeddings`` is the
    number of ``V x h`` matrices (1 with tied embeddings or a scalar-head model, 2 otherwise)."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int = 0  # key/value heads x head dim (0: hidden, as without GQA)
    embeddings: int = 2
    experts: int = 0  # routed expert parameters, all layers (X; 0: dense)
    num_experts: int = 0  # routed experts per MoE layer
    top_k: int = 0  # experts per token

    @property
    def layer_params(self) -> int:
        embed = self.embeddings * self.vocab * self.hidden
        return max(0, self.params - embed) // max(1, self.layers)

    def gathered_layer_params(self, ep: int = 1) -> int:
        """One layer as a forward gathers it: its routed experts split ``ep`` ways."""
        experts = self.experts // max(1, self.layers)
        return self.layer_params - experts + experts // ep

    def gathered_params(self, ep: int = 1) -> int:
        """The whole model as a rank gathers it (ZeRO<3): routed experts split ``ep`` ways."""
        return self.params - self.experts + self.experts // ep

    @property
    def root_params(self) -> int:
        """Embeddings + LM head (+ norms): FSDP2's root unit, gathered with every forward."""
        return self.params - self.layers * self.layer_params

    @staticmethod
    def from_hf_config(
        config: dict,
        params: int | None = None,
        embeddings: int | None = None,
        experts: int | None = None,
    ) -> ModelShape:
        """``embeddings``: the ``V x h`` matrices the checkpoint holds (None: 1 when
        ``tie_word_embeddings``, else 2); ``experts``: routed expert parameters (None: from
        the config, every layer sparse)."""
        h, n_layers = config["hidden_size"], config["num_hidden_layers"]
        inter, vocab = config.get("intermediate_size", 4 * h), config["vocab_size"]
        if embeddings is None:
            embeddings = 1 if config.get("tie_word_embeddings", False) else 2
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or heads
        # Qwen2/2.5 configs have no head_dim key, others set it to null: one rule for both
        per_head = head_dim({**config, "num_attention_heads": heads})
        n_experts = next(
            (int(config[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts")
             if config.get(k)),
            0,
        )  # fmt: skip
        top_k = int(config.get("num_experts_per_tok") or 0) if n_experts else 0
        if experts is None and n_experts:  # SwiGLU experts in every layer
            moe_inter = config.get("moe_intermediate_size") or inter
            experts = n_layers * n_experts * 3 * h * moe_inter
        experts = experts or 0
        if params is None:  # Llama-style: q,k,v,o + gate,up,down per layer
            attn = h * heads * per_head * 2 + 2 * h * kv * per_head
            mlp = 3 * h * inter if not n_experts else n_experts * h  # MoE: the router
            params = n_layers * (attn + mlp) + experts + embeddings * vocab * h
        kv_dim = _mean_kv_dim(config, n_layers, kv * per_head)
        return ModelShape(
            params, n_layers, h, inter, vocab, kv_dim, embeddings, experts, n_experts, top_k
        )


def _mean_kv_dim(config: dict, n_layers: int, default: int) -> int:
    """Key/value width per layer, averaged over all layers: each attention layer's own heads
    and head size (Gemma 4's global layers are wider than its sliding ones), none for the
    recurrent layers of hybrid models. ``default`` (the top config's) for a model type the
    installed transformers does not parse."""
    try:
        layers = attention_layers(config)
    except (KeyError, ValueError, TypeError):
        return default
    return max(1, round(sum(layer.kv_dim for layer in layers) / max(1, n_layers)))


@dataclass(frozen=True)
class JobFlags:
    """The flags memory depends on, per device (one rank per GPU)."""

    world: int
    device_bytes: int
    zero_stage: int = 2
    bf16: bool = True
    adam_offload: bool = False
    ref_reward_offload: bool = False
    gpu_memory_utilization: float = 0.9
    vllm_sleep: bool = True
    micro_train_batch_size: int = 1
    micro_rollout_batch_size: int = 1
    seq_len: int = 2048
    response_len: int = 1024  # generate_max_len: the positions whose logits are computed
    gradient_checkpointing: bool = False
    # --gradient_checkpointing_policy: "full" keeps each layer's input, "selective" the outputs
    # of its matmuls and attention too (models.checkpointing)
    checkpointing_policy: str = "full"
    # ZeRO-3 with --accumulate_gathered: the update holds every layer gathered and the grads
    # unsharded across micro-batches, as below ZeRO-3
    accumulate_gathered: bool = False
    critic: bool = True
    reward: bool = True
    vllm_pool_bytes: int = 0  # vLLM on CPU sizes its pool in GiB, not as a fraction: 0 = GPU
    lora: bool = False  # --lora_rank: frozen bases, no reference model (adapters are ~0 bytes)
    engine: str = "vllm"  # --rollout_engine: "hf" holds an unsharded actor copy, no pool
    rollout_seqs: int = 1  # sequences one rank generates at once (the HF engine's KV cache)
    ema: bool = False  # --enable_ema: fp32 copy of the actor's trainable shards
    cuda_graphs: bool = True  # not --enforce_eager: vLLM keeps a CUDA-graph pool asleep too
    vllm_tp: int = 1  # --vllm_tensor_parallel_size: the engine holds 1/tp of the weights
    # --weight_sync delta on a CPU job: the mirror of the synced weights (engine dtype, the
    # whole model on every rank) lives in host memory, which a CPU job's phases count
    sync_mirror: bool = False
    expert_parallel: int = 1  # --expert_parallel_size: ranks splitting each MoE layer's experts
    teacher_offload: bool = False  # --teacher_offload: the teacher's shard on the host between uses

    @property
    def ema_on_device(self) -> bool:
        """The EMA stays beside the shards unless an offload flag sends it to the host
        (``ppo.setup.build_ema``)."""
        return self.ema and not (self.adam_offload or self.ref_reward_offload)

    sequence_parallel: int = 1  # --sequence_parallel_size: ranks sharing each sequence
    packing: bool = False  # --packing_samples: causal attention per sequence, no mask
    flash_attn: bool = False  # --flash_attn: flash-attn's kernels, no mask
    shared_prompts: int = 1  # > 1: the actor's rows share their prompt pass, n per prompt

    @property
    def pool(self) -> int:
        """vLLM's weights + KV cache pool (none with the HF engine)."""
        if self.engine == "hf":
            return 0
        return self.vllm_pool_bytes or int(self.gpu_memory_utilization * self.device_bytes)

    @property
    def asleep(self) -> int:
        """What the rollout engine keeps on the device while the trainer works."""
        if self.engine in ("hf", "none"):
            return 0  # the HF engine's copy is counted as resident; "none": an offline job
        if not self.vllm_sleep:
            return self.pool
        return VLLM_ASLEEP_BYTES + (VLLM_CUDA_GRAPH_BYTES if self.cuda_graphs else 0)

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence one rank holds (the whole sequence without SP)."""
        return -(-self.seq_len // self.sequence_parallel)

    @property
    def local_response_len(self) -> int:
        """Response positions one rank computes logits for."""
        return -(-self.response_len // self.sequence_parallel)


@dataclass
class Phase:
    name: str
    parts: dict[str, int] = field(default_factory=dict)
    limit: int = 0
    fix: str = ""  # the flag to change when the phase does not fit

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def line(self) -> str:
        worst = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        top = ", ".join(f"{k} {v / GIB:.1f}" for k, v in worst)
        mark = "fits" if self.fits else "DOES NOT FIT"
        return f"{self.name}: {self.total / GIB:.1f} of {self.limit / GIB:.1f} GiB {mark} ({top})"


def logprob_chunk_bytes(positions: int, vocab: int) -> int:
    """fp32 temporaries of one log-prob chunk (``LOGPROB_CHUNK_BYTES``): a chunk holds
    ``CHUNK_ELEMENTS // vocab`` positions, and no more than the logits have."""
    rows = min(positions, max(1, CHUNK_ELEMENTS // vocab))
    return 4 * 4 * rows * vocab


def _frozen_bytes(f: JobFlags) -> int:
    return 2 if f.bf16 else 4  # frozen models load in bf16 under --bf16 (models.load)


def _teacher_shard(f: JobFlags, teacher: ModelShape | None) -> dict:
    """On-policy distillation's colocated teacher: its frozen shard, resident unless
    ``--teacher_offload`` keeps it on the host (a served teacher: nothing here)."""
    if teacher is None or f.teacher_offload:
        return {}
    return {"teacher shard": _frozen_bytes(f) * teacher.params // f.world}


def resident_during_rollout(
    f: JobFlags, actor: ModelShape, frozen: list[ModelShape], teacher: ModelShape | None = None
) -> dict:
    """Trainer memory that stays on the device while vLLM holds its pool. The trainer offloads
    the actor's optimizer and the whole critic between their updates; with ``--adam_offload``
    the trainable shards live on the host anyway."""
    parts = {"cuda context + nccl": CONTEXT_BYTES}
    if f.engine == "hf":
        parts["hf engine copy"] = f.dtype_bytes * actor.params
    if not f.adam_offload:
        parts["actor fp32 shard"] = 4 * actor.params // f.world
    if not f.ref_reward_offload:
        parts["ref/reward shards"] = sum(_frozen_bytes(f) * m.params for m in frozen) // f.world
    parts.update(_teacher_shard(f, teacher))
    parts.update(_ema(f, actor))
    parts.update(_mirror(f, actor))
    return parts


def _mirror(f: JobFlags, actor: ModelShape) -> dict:
    """Delta sync's copy of the synced weights, resident through every phase."""
    return {"weight-sync mirror": f.dtype_bytes * actor.params} if f.sync_mirror else {}


def _ema(f: JobFlags, actor: ModelShape) -> dict:
    """The actor's EMA (fp32 shards of its trainable params) when it stays on the device."""
    if not f.ema_on_device or f.lora:  # LoRA: only the adapters are averaged (~0 bytes)
        return {}
    return {"actor EMA shard": 4 * actor.params // f.world}


def _with_slack(parts: dict) -> dict:
    """``parts`` plus the caching allocator's slack on the trainer's tensors among them (not on
    vLLM's pool, mapped outside it, nor on the CUDA context)."""
    outside = ("vllm pool", "cuda context + nccl")
    tensors = sum(v for k, v in parts.items() if k not in outside)
    return {**parts, "allocator slack": int(ALLOCATOR_SLACK * tensors)}


def activation_bytes(f: JobFlags, m: ModelShape, b: int) -> int:
    """Activations one rank keeps for backward over ``b`` sequences (its 1/N of each)."""
    s = f.local_seq_len
    per_layer = 2 * b * s * (9 * m.hidden + 3 * m.intermediate)
    if not f.gradient_checkpointing:
        kept = m.layers * per_layer
    elif f.checkpointing_policy == "selective":
        # the layer input and every matmul's and the attention's output (q, k, v, attention,
        # o_proj, gate, up, down) kept; one layer's recomputed elementwise outputs and grads
        kv = m.kv_dim or m.hidden
        saved = 2 * b * s * (5 * m.hidden + 2 * kv + 2 * m.intermediate)
        kept = m.layers * saved + 2 * per_layer
    else:  # layer inputs kept; one layer's activations and their grads live during its recompute
        kept = m.layers * 2 * b * s * m.hidden + 2 * per_layer
    if f.sequence_parallel > 1:  # one layer's q, k, v and output, sent and received (bf16)
        kept += 2 * 2 * b * s * (2 * m.hidden + 2 * (m.kv_dim or m.hidden))
    return kept + all_to_all_bytes(f, m, b)


def all_to_all_bytes(f: JobFlags, m: ModelShape, b: int) -> int:
    """One MoE layer's token exchange under expert parallelism: each of ``b`` sequences' local
    tokens goes to its ``k`` experts and comes back, sent and received (bf16); 0 without."""
    if f.expert_parallel <= 1 or not m.top_k:
        return 0
    return 2 * 4 * b * f.local_seq_len * m.top_k * m.hidden


def attention_mask_bytes(f: JobFlags, m: ModelShape, b: int, shared_prompts: bool) -> int:
    """The attention masks one rank keeps for backward over ``b`` sequences (see the module
    docstring): padded rows without sequence parallelism, HF's ``(b, 1, s, s)``; shared-prompt
    rows (``shared_prompts``: the actor's forwards under ``--share_prompt_prefix``), the
    prompts' ``(b / n, 1, P, P)`` and the responses' ``(b, 1, T, P + T)``, not divided by the
    sequence-parallel size; 0 for packed rows, flash-attn and Ulysses' padded rows
    (``models.attention.span_attention``)."""
    if f.packing or f.flash_attn:
        return 0
    s, T = f.seq_len, min(f.response_len, f.seq_len)
    P = s - T
    if shared_prompts and f.shared_prompts > 1:
        per_layer = -(-b // f.shared_prompts) * P * P + b * T * (P + T)
    elif f.sequence_parallel > 1:
        return 0
    else:
        per_layer = b * s * s
    layers = 1 if f.gradient_checkpointing else m.layers
    return f.dtype_bytes * layers * per_layer


def _gathered(f: JobFlags, m: ModelShape) -> dict:
    """Unsharded params and grads during the update.

    ZeRO-3: the current layer, the prefetched one and the root (gathered through the whole
    backward), plus the unsharded grads of the largest group and its fp32 reduce-scatter input
    (FSDP2 reduces in fp32, ``MixedPrecisionPolicy(reduce_dtype=float32)``): the root's, whose
    LM-head grad appears first in backward and is reduced last, with the embedding's. Below
    ZeRO-3: every param gathered and the grads accumulated unsharded in fp32 until the last
    micro-batch, then copied group by group into the reduce-scatter input."""
    E = f.expert_parallel
    layer = m.gathered_layer_params(E)
    group = max(m.root_params, layer)
    if f.zero_stage >= 3 and not f.accumulate_gathered:
        return {
            "gathered layers": f.dtype_bytes * (2 * layer + m.root_params),
            "root grads + fp32 reduce-scatter input": (f.dtype_bytes + 4) * group,
        }
    return {
        "gathered params": f.dtype_bytes * m.gathered_params(E),
        "unsharded grads": 4 * m.gathered_params(E),
        "fp32 reduce-scatter input": 4 * group,
    }


def update_phase(
    f: JobFlags,
    name: str,
    m: ModelShape,
    logits: bool,
    frozen: list,
    actor: ModelShape | None = None,
    teacher: ModelShape | None = None,
) -> Phase:
    per_param = 4 if f.lora else 4 + 4 + 8  # LoRA: fp32 base shards; no grads or Adam state
    states = 0 if f.adam_offload else per_param * m.params // f.world
    gathered = _gathered(f, m)
    if f.lora:  # frozen base: no grads to hold or reduce
        for k in list(gathered):
            if "grads" in k or "reduce-scatter" in k:
                del gathered[k]
    parts = {"params+grads+adam shards": states, **gathered}
    parts["activations"] = activation_bytes(f, m, f.micro_train_batch_size)
    masks = attention_mask_bytes(f, m, f.micro_train_batch_size, shared_prompts=logits)
    if masks:
        parts["attention masks"] = masks
    if logits:  # the kept logits, their gradient, one chunk's fp32 temporaries
        kept = f.dtype_bytes * f.micro_train_batch_size * f.local_response_len * m.vocab
        positions = f.micro_train_batch_size * f.local_response_len
        parts["logits"] = 2 * kept + logprob_chunk_bytes(positions, m.vocab)
    parts["cuda context + nccl"] = CONTEXT_BYTES
    if actor is not None and not f.adam_offload:  # the critic's update: the actor stays
        parts["actor fp32 shard"] = 4 * actor.params // f.world
    if f.engine == "hf":
        parts["hf engine copy"] = f.dtype_bytes * (actor or m).params
    if not f.ref_reward_offload:
        parts["ref/reward shards"] = sum(_frozen_bytes(f) * x.params for x in frozen) // f.world
    parts.update(_teacher_shard(f, teacher))
    parts.update(_ema(f, actor or m))
    parts.update(_mirror(f, actor or m))
    parts["vllm"] = f.asleep
    if not f.vllm_sleep:
        fix = "--vllm_enable_sleep (vLLM keeps its pool while training)"
    elif f.adam_offload:
        fix = "--micro_train_batch_size (lower) or --gradient_checkpointing"
    else:
        fix = "--adam_offload (or --zero_stage 3, lower --micro_train_batch_size)"
    return Phase(name, parts, int(TRAIN_HEADROOM * f.device_bytes), fix)


def scoring_phase(
    f: JobFlags,
    actor: ModelShape,
    frozen: list[ModelShape],
    critic: ModelShape | None = None,
    teacher: ModelShape | None = None,
) -> Phase:
    """The no-grad passes, one model at a time; the phase holds the larger of

    * a policy pass (old log-probs, reference, reward, teacher): the largest model's gathered
      layer and root (its shard too when ``--ref_reward_offload`` / ``--teacher_offload``
      onloads it), the logits;
    * the critic's values: its fp32 shard, onloaded for this pass and kept through its update
      (``PPOTrainer.forward_old_ref_values``), and its gathered layer and root.
    """
    scored = [actor, *frozen, *([teacher] if teacher is not None else [])]
    b, biggest = f.micro_rollout_batch_size, max(scored, key=lambda m: m.params)
    base = resident_during_rollout(f, actor, frozen, teacher)
    base["vllm"] = f.asleep if f.vllm_sleep else 0
    parts = dict(base)
    if f.ref_reward_offload:  # the scored model is onloaded for its pass
        parts["scored model shard"] = _frozen_bytes(f) * biggest.params // f.world
    if teacher is not None and f.teacher_offload:  # onloaded for its pass (an upper bound)
        parts["teacher shard (onloaded)"] = _frozen_bytes(f) * teacher.params // f.world
    layer = biggest.gathered_layer_params(f.expert_parallel)
    parts["gathered layer + root"] = 2 * (layer + biggest.root_params)
    # the response positions' logits and one chunk's fp32 temporaries
    logits = f.dtype_bytes * b * f.local_response_len * actor.vocab
    parts["logits"] = logits + logprob_chunk_bytes(b * f.local_response_len, actor.vocab)
    if critic is not None:
        values = dict(base)
        if not f.adam_offload:  # under CPUOffloadPolicy its shard stays on the host
            values["critic fp32 shard"] = 4 * critic.params // f.world
        critic_layer = critic.gathered_layer_params(f.expert_parallel)
        values["gathered layer + root"] = 2 * (critic_layer + critic.root_params)
        if sum(values.values()) > sum(parts.values()):
            parts = values
    fix = "--micro_rollout_batch_size (lower)"
    return Phase("scoring (no-grad)", parts, int(TRAIN_HEADROOM * f.device_bytes), fix)


def hf_generation(f: JobFlags, actor: ModelShape) -> dict:
    """What HF ``generate`` adds on one rank (``HFEngine.generate``, all its rows at once):
    the KV cache of every row at full length, the processed scores of every step (fp32,
    ``output_scores``: the engine's log-probs are read from them after the last step), a
    step's fp32 temporaries (the logits' fp32 copy, the processed scores, the sampling
    probabilities, and afterwards one step's log-softmax), and one layer's activations of the
    prompts' forward (the prefill)."""
    rows = f.rollout_seqs
    kv = 2 * actor.layers * (actor.kv_dim or actor.hidden) * f.dtype_bytes * f.seq_len
    prompt = max(0, f.seq_len - f.response_len)
    return {
        "hf kv cache": kv * rows,
        "hf scores": 4 * rows * f.response_len * actor.vocab,
        "hf step temporaries": 4 * 4 * rows * actor.vocab,
        "hf prefill layer": 2 * rows * prompt * (9 * actor.hidden + 3 * actor.intermediate),
    }


def hf_sync_bytes(f: JobFlags, actor: ModelShape) -> int:
    """The weight sync into the HF copy (``fsdp.iter_full_params``): a bucket of full tensors
    (at most ``SYNC_BUCKET_BYTES``, at most the whole model) is its received tensor and this
    rank's 1/W send buffer; the previous bucket's received tensor lives until the copy has
    read its last tensor."""
    bucket = min(SYNC_BUCKET_BYTES, f.dtype_bytes * actor.params)
    return 2 * bucket + bucket // f.world


def plan_phases(
    f: JobFlags,
    actor: ModelShape,
    critic: ModelShape | None,
    frozen: list[ModelShape],
    teacher: ModelShape | None = None,
) -> list[Phase]:
    """Every phase of a PPO step on one device, in step order (``teacher``: on-policy
    distillation's colocated teacher)."""
    pool = f.pool
    resident = resident_during_rollout(f, actor, frozen, teacher)
    util_fix = "--vllm_gpu_memory_utilization (lower) or --adam_offload / --ref_reward_offload"
    if f.engine == "hf":  # the sync into the local copy, then generation: never both
        gen = hf_generation(f, actor)
        sync = {"sync buckets": hf_sync_bytes(f, actor)}
        rollout_parts = {**resident, **(gen if sum(gen.values()) >= sum(sync.values()) else sync)}
        fix = "--micro_rollout_batch_size / --rollout_batch_size (lower)"
        phases = [Phase("rollout", _with_slack(rollout_parts), f.device_bytes, fix)]
    else:
        wake_parts = _with_slack({"vllm pool": pool, **resident})
        wake = Phase("vllm start-up/wake", wake_parts, f.device_bytes, util_fix)
        rollout_parts = {"vllm pool": pool, **resident, "sync buckets": 2 * SYNC_BUCKET_BYTES}
        phases = [wake, Phase("rollout", _with_slack(rollout_parts), f.device_bytes, util_fix)]
    phases.append(scoring_phase(f, actor, frozen, critic, teacher))
    phases.append(
        update_phase(f, "actor update", actor, logits=True, frozen=frozen, teacher=teacher)
    )
    if critic is not None:
        phases.append(
            update_phase(f, "critic update", critic, False, frozen, actor=actor, teacher=teacher)
        )
    return phases


def gathered_update_fits(
    f: JobFlags, actor: ModelShape, critic: ModelShape | None, frozen: list[ModelShape]
) -> bool:
    """``--accumulate_gathered auto`` at ZeRO-3: whether every update phase fits with each
    layer gathered once per optimizer step and the grads unsharded until its last micro-batch
    (``distributed.fsdp.accumulate``)."""
    at = replace(f, accumulate_gathered=True)
    phases = [
        update_phase(at, "actor update", actor, logits=True, frozen=frozen),
        *([update_phase(at, "critic update", critic, False, frozen, actor)] if critic else []),
    ]
    return all(p.fits for p in phases)


def engine_only_phases(f: JobFlags) -> list[Phase]:
    """A rollout rank of an asynchronous job (docs/async.md): its device holds its engine's
    TP slice and nothing of the trainer. vLLM's pool (never asleep; the engine's weights are in
    it), the CUDA context and NCCL, and the weight buckets it receives (the next one arrives
    while the engine loads the last)."""
    parts = {
        "vllm pool": f.pool,
        "cuda context + nccl": CONTEXT_BYTES,
        "weight buckets": 2 * SYNC_BUCKET_BYTES,
    }
    fix = "--vllm_gpu_memory_utilization (lower)"
    return [Phase("rollout rank (vLLM only)", _with_slack(parts), f.device_bytes, fix)]


def pool_fraction_limit(
    f: JobFlags,
    actor: ModelShape,
    critic: ModelShape | None,
    frozen: list[ModelShape],
    teacher: ModelShape | None = None,
) -> float:
    """The largest ``--vllm_gpu_memory_utilization`` with which every phase that holds vLLM's
    pool fits (wake and rollout; every phase when the engine does not sleep). 1.0 when no
    phase holds it (the HF engine); below 0 when nothing fits even without a pool."""
    return fraction_limit(lambda g: plan_phases(g, actor, critic, frozen, teacher), f)


def fraction_limit(plan: Callable[[JobFlags], list[Phase]], f: JobFlags) -> float:
    """:func:`pool_fraction_limit` of any plan (``plan(flags)``: its phases)."""
    empty = dataclasses.replace(f, gpu_memory_utilization=0.0, vllm_pool_bytes=0)
    full = dataclasses.replace(f, gpu_memory_utilization=1.0, vllm_pool_bytes=0)
    best = 1.0
    for p0, p1 in zip(plan(empty), plan(full), strict=True):
        per_unit = p1.total - p0.total  # bytes the phase grows by per unit of utilization
        if per_unit > 0:
            best = min(best, (p0.limit - p0.total) / per_unit)
    return best


def engine_weight_bytes(f: JobFlags, actor: ModelShape) -> int:
    """The actor's weights in one engine's TP slice (vLLM loads them into its pool)."""
    return f.dtype_bytes * actor.params // max(1, f.vllm_tp)


def lora_reference_savings(f: JobFlags, actor: ModelShape) -> int:
    """Bytes per device that --lora_rank saves by using the actor's frozen base (adapters
    disabled) as the reference instead of a sharded reference copy."""
    return _frozen_bytes(f) * actor.params // f.world


def verdict(phases: list[Phase]) -> tuple[bool, str]:
    """(fits, one line naming each phase that does not fit and the flag to change)."""
    bad = [p for p in phases if not p.fits]
    if not bad:
        return True, "every phase fits: " + "; ".join(p.line() for p in phases)
    return False, "; ".join(f"{p.line()} -> change {p.fix}" for p in bad)


def expert_parallel_options(world: int, num_experts: int) -> list[int]:
    """The ``--expert_parallel_size`` values a job can use: divisors of the world size that
    divide the experts per layer, ascending (``[1]`` for a dense model)."""
    if not num_experts:
        return [1]
    return [e for e in range(1, world + 1) if world % e == 0 and num_experts % e == 0]


def sequence_parallel_options(
    world: int, heads: int, kv_heads: int, more: tuple[tuple[int, int], ...] = ()
) -> list[int]:
    """The ``--sequence_parallel_size`` values a job can use: divisors of the world size that
    split the attention heads (``models.ulysses.head_problem``) of every attention layer
    (``more``: other layers' (heads, key/value heads), e.g. Gemma 4's global layers), ascending."""
    shapes = [(heads, kv_heads), *more]
    out = []
    for n in range(1, world + 1):
        if world % n:
            continue
        if n == 1 or all(h % n == 0 and (kv % n == 0 or n % kv == 0) for h, kv in shapes):
            out.append(n)
    return out


def sequence_parallel_needed(
    f: JobFlags,
    actor: ModelShape,
    critic: ModelShape | None,
    frozen: list[ModelShape],
    options: list[int],
) -> tuple[int | None, list[Phase]]:
    """The smallest of ``options`` (sequence-parallel sizes) with which every phase fits, and
    its phases; ``(None, phases at the largest option)`` when none does."""
    phases: list[Phase] = []
    for n in options:
        phases = plan_phases(replace(f, sequence_parallel=n), actor, critic, frozen)
        if all(p.fits for p in phases):
            return n, phases
    return None, phases
