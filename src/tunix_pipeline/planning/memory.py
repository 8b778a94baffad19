"""Memory per device of one Tunix SFT train step, from the model's shape alone.

What the step holds at its peak (the start of the backward pass), per device:

- parameters: the weights, sharded over fsdp x tp (replicated over data);
  Tunix's jitted step donates the optimizer state but not the model, so a
  trained weight exists twice while the step runs (the input and the update);
  `sft.compute_dtype: bfloat16` adds a bf16 copy of fp32 master weights;
- gradients of the trained weights and the optimizer state (AdamW: two
  moments in the parameter dtype; Adafactor: factored second moments);
  gradient accumulation (optax.MultiSteps) adds a gradient-sized buffer;
- activations kept for the backward pass, per layer: the gated MLP's
  intermediates and its input, the attention scores (batch x heads x length x
  length, in several copies), and the layer's all-gathered weights (XLA keeps
  the fsdp all-gather of the forward pass for the backward pass); remat keeps
  only each block's input and recomputes one layer at a time;
- logits: the loss upcasts batch x length x vocabulary logits to float32 (only
  a chunk of positions at a time with `sft.loss_chunk_size`); with the
  compute-dtype copy and the gathered output head this is what makes Gemma's
  256k vocabulary expensive.

How many copies XLA keeps of each kind was fitted to XLA's own figures for
this step (`memory_analysis()` of the compiled program, `planning.xla`): the
TPU compiler's (deviceless compilation with libtpu, Gemma-2B and
Qwen2.5-0.5B shapes) for accelerators, the CPU compiler's on the fake 8-device
mesh for the `cpu` backend. `tests/test_planning.py` keeps them honest.
"""

from __future__ import annotations

import dataclasses

from tunix_pipeline.planning.architecture import Architecture

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2}
# bytes per weight of a frozen nf4 base: 4 bits and a float32 scale per block of 64
NF4_BYTES = 0.5 + 4 / 64


@dataclasses.dataclass(frozen=True)
class Coefficients:
    """How much of each kind of tensor XLA keeps (per token and per layer unless said otherwise)."""

    mlp_bytes: dict  # per intermediate feature of the gated MLP (gate, up, product, ...), by compute dtype
    hidden_copies: float  # batch x length x hidden tensors, compute dtype
    score_bytes: dict  # per attention score (heads x length per token), by compute dtype
    logit_f32_copies: float  # float32 batch x length x vocabulary buffers of the loss
    logit_compute_copies: float  # the same in the compute dtype (bf16 models only)
    head_copies: float  # the output head's all-gathered weight and its gradient, compute dtype
    gathered_layers: float  # all-gathered layer weights kept for the backward pass, per layer (fsdp > 1)
    vocab_over_tp: bool  # whether the logits and the output head are split over tp


# XLA:TPU (v5e 2x4, deviceless compilation with libtpu): Gemma-2B shape, 1-2 layers, length
# 512/1024, bf16 and f32, fsdp 8 and fsdp 4 x tp 2, remat none/decoder: within ~10%, the whole
# 18-layer model (extrapolated) within +5%; the TPU does not split the loss over tp. Qwen2.5-0.5B's
# GQA attention keeps less than Gemma's (the estimate is ~30% over per layer at length 1024, close
# at 512). Used for TPUs and GPUs. Against the plan's own XLA:TPU compile (libtpu 0.0.42, layers 2
# and 3 extrapolated; `benchmarks/tpu_memory.py --recipes`): tpu_full's step +4%, Qwen2.5-0.5B's
# (qwen05b_v5e8) -25%, the 7M pod model's (v4_64_pod) -25%: to be refitted there.
ACCELERATOR = Coefficients(
    mlp_bytes={"bfloat16": 6.0, "float32": 12.0},
    hidden_copies=1.0,
    score_bytes={"bfloat16": 11.0, "float32": 5.2},
    logit_f32_copies=1.0,
    logit_compute_copies=1.0,
    head_copies=2.0,
    gathered_layers=1.0,
    vocab_over_tp=False,
)
# XLA:CPU on the fake 8-device mesh (the tiny model; Gemma-2B shapes in float32). The CPU keeps
# more of the GELU's intermediates and computes bf16 matmuls in float32.
CPU = Coefficients(
    mlp_bytes={"bfloat16": 28.8, "float32": 28.8},
    hidden_copies=1.0,
    score_bytes={"bfloat16": 7.5, "float32": 7.5},
    logit_f32_copies=3.0,
    logit_compute_copies=0.0,
    head_copies=1.0,
    gathered_layers=1.0,
    vocab_over_tp=True,
)


def coefficients(backend: str) -> Coefficients:
    return CPU if backend == "cpu" else ACCELERATOR


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """What memory depends on besides the model: how it is trained and sharded."""

    per_device_batch: int
    seq_len: int
    data: int = 1
    fsdp: int = 1
    tp: int = 1
    param_dtype: str = "float32"  # model.dtype
    compute_dtype: str | None = None  # sft.compute_dtype: bf16 compute over fp32 master weights
    backend: str = "tpu"  # cpu | gpu | tpu: which fitted coefficients apply
    mode: str = "full"  # full | lora | qlora
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    optimizer: str = "adamw"  # adamw | adafactor
    grad_accum: int = 1
    remat: str = "none"  # none | attention | decoder (Tunix's RematConfig BLOCK / DECODER)
    loss_chunk: int | None = None  # sft.loss_chunk_size

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tp

    @property
    def mesh(self) -> dict:
        return {"data": self.data, "fsdp": self.fsdp, "tp": self.tp}

    @property
    def c_dtype(self) -> str:
        return self.compute_dtype or self.param_dtype

    @property
    def c_bytes(self) -> int:
        return BYTES[self.c_dtype]

    @property
    def p_bytes(self) -> int:
        return BYTES[self.param_dtype]

    def replace(self, **changes) -> "TrainSetup":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device."""

    params: float  # every weight the step holds (a trained weight twice: input and update)
    grads: float
    optimizer: float
    activations: float  # kept for the backward pass, all layers
    logits: float  # the loss's logits and the output head's gathered weights
    peak: float
    trainable_params: int
    total_params: int

    def as_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k.endswith("_params")}
        out.update({f"{k}_gib": round(v / GIB, 3) for k, v in dataclasses.asdict(self).items() if not k.endswith("_params")})
        return out


def estimate_memory(arch: Architecture, setup: TrainSetup) -> MemoryEstimate:
    s = setup
    k = coefficients(s.backend)
    c, p = s.c_bytes, s.p_bytes
    shards = s.fsdp * s.tp  # weights are replicated over the data axis
    tokens = s.per_device_batch * s.seq_len  # rows per data-parallel device; tp splits features and heads
    d, f = arch.hidden_size, arch.intermediate_size
    layers = arch.num_layers
    matrices = arch.embedding_params + layers * arch.layer_matrix_params
    vectors = arch.params - matrices
    weights_dev = matrices / shards + vectors / s.tp

    if s.mode == "full":
        trainable = arch.params
        trainable_dev = weights_dev
        params = 2 * weights_dev * p  # the step's input and its updated output
        frozen_bytes = c
    else:
        trainable = arch.lora_params(s.lora_rank, s.lora_targets)
        trainable_dev = trainable  # adapters are small: counted unsharded
        frozen_bytes = NF4_BYTES if s.mode == "qlora" else p
        params = weights_dev * frozen_bytes + 2 * trainable_dev * p
    if s.compute_dtype and s.compute_dtype != s.param_dtype and s.mode != "qlora":
        params += weights_dev * c  # the weights cast to the compute dtype
    grads = trainable_dev * p
    if s.optimizer == "adamw":
        optimizer = 2 * trainable_dev * p
    else:
        optimizer = _adafactor_state(arch, s) if s.mode == "full" else 0.1 * trainable_dev * 4
    if s.grad_accum > 1:
        optimizer += trainable_dev * p  # optax.MultiSteps' gradient accumulator

    # activations kept for the backward pass
    per_token = (k.mlp_bytes[s.c_dtype] * f + k.hidden_copies * d * c) / s.tp
    scores = arch.num_heads * s.seq_len / s.tp * k.score_bytes[s.c_dtype]
    layer_weights = arch.layer_matrix_params / s.tp * (c if s.mode == "full" else frozen_bytes)
    gathered = k.gathered_layers * layer_weights if s.fsdp > 1 else 0.0
    one_layer = tokens * (per_token + scores)
    if s.remat == "none":
        activations = layers * (one_layer + gathered)
    else:  # each block's input (and output) is kept; one layer at a time is recomputed
        kept = (4 if s.remat == "attention" else 1) * tokens * d / s.tp * c
        activations = layers * (kept + gathered) + one_layer

    # the loss's logits and the output head
    vocab_tp = s.tp if k.vocab_over_tp else 1
    vocab_dev = arch.vocab_size / vocab_tp
    f32_positions = tokens if not s.loss_chunk else s.per_device_batch * min(s.loss_chunk, s.seq_len)
    compute_copies = k.logit_compute_copies if c < 4 else 0.0
    logits = vocab_dev * (f32_positions * k.logit_f32_copies * 4 + tokens * compute_copies * c)
    if s.loss_chunk:
        # one whole batch x length x vocabulary buffer beside the chunks: the model's logits (float32
        # runs; bf16 runs count them above) or, in bf16, their gradient assembled chunk by chunk
        # (XLA:TPU, tpu_full's step: ~2 GiB more than the unchunked copies say at 4 x 1024 tokens)
        logits += tokens * vocab_dev * c
    head = arch.vocab_size * d / vocab_tp * c
    logits += k.head_copies * head if s.fsdp > 1 else head

    embed_grads = arch.embedding_params / shards * p if s.mode == "full" else 0.0
    peak = params + optimizer + max(activations + logits + embed_grads, grads + one_layer)
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        logits=logits,
        peak=peak,
        trainable_params=int(trainable),
        total_params=int(arch.params + (trainable if s.mode != "full" else 0)),
    )


def _adafactor_state(arch: Architecture, s: TrainSetup) -> float:
    """Row and column second moments (float32) per matrix; vectors keep a full second moment."""
    d, f, h = arch.hidden_size, arch.intermediate_size, arch.head_dim
    per_layer = (d + arch.num_heads * h) * 2 + (d + arch.num_kv_heads * h) * 2 + 3 * (d + f)
    heads = 1 if arch.tied_embeddings else 2
    rows_cols = arch.num_layers * per_layer + (arch.vocab_size + d) * heads
    vectors = arch.params - arch.embedding_params - arch.num_layers * arch.layer_matrix_params
    return (rows_cols + vectors) * 4 / s.tp


def checkpoint_bytes(arch: Architecture, setup: TrainSetup) -> float:
    """What one Orbax checkpoint writes: the trained weights and the optimizer state (all devices)."""
    whole = estimate_memory(arch, setup.replace(data=1, fsdp=1, tp=1))
    return whole.grads + whole.optimizer  # trained weights are gradient-sized


def reference_bytes(arch: Architecture, setup: TrainSetup, trainable_params: int) -> float:
    """Per device: a frozen reference policy beside the trained one (DPO, GRPO's KL term): a whole copy
    of the weights, sharded as the policy's, with full fine-tuning; with LoRA only the adapters, as the
    reference shares the base arrays."""
    if setup.mode == "full":
        matrices = arch.embedding_params + arch.num_layers * arch.layer_matrix_params
        return (matrices / (setup.fsdp * setup.tp) + (arch.params - matrices) / setup.tp) * setup.p_bytes
    return trainable_params * setup.p_bytes
