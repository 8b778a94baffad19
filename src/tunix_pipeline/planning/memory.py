"""Memory per device of one Tunix SFT train step, from the model's shape alone.

XLA reports a step's memory as arguments + outputs - aliases + temporaries; the
estimate counts the same buffers, per device.

Resident (arguments and outputs): the weights, sharded over fsdp x tp
(replicated over data); Tunix's jitted step donates the optimizer state but not
the model, so a trained weight exists twice (the input and the update). AdamW
keeps two moments in the parameter dtype, Adafactor factored second moments;
gradient accumulation (optax.MultiSteps) keeps a gradient-sized accumulator.

Temporaries (what XLA:TPU keeps live, read off its compiled buffer assignment for
Gemma-2B and Qwen2.5-0.5B on a v5e 2x4; `planning.xla`):
the peak is the larger of the forward-backward pass's and the optimizer
update's (XLA reuses the same memory for both). The forward-backward peak is at
the loss: every layer's saved tensors, plus the output head's all-gathered
weights and their unreduced gradient and the logits. Without remat a layer
saves its activations (the softmax's output of the attention scores, the gated
MLP's projections, q/k/v); with remat only its input.

Every term has a mechanism; none is fitted. The estimate is the first answer (a
GPU planned from here, a TPU without libtpu); where the run's own compiler is at
hand (XLA:TPU, or XLA:CPU for this CPU, which keeps more: no bf16 matmul, fewer
fusions) the plan rests on its compiled figure instead (`planning.xla_check`).
"""

from __future__ import annotations

import dataclasses
import math

from tunix_pipeline.config import DEFAULT_LOSS_CHUNK
from tunix_pipeline.models.architecture import Architecture

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2}
# what XLA:TPU keeps of one chunk's float32 (batch, chunk, vocabulary) logits at the loss's peak, in copies: with
# a trained head it fuses the softmax and its gradient into the matmuls (Gemma-2B, one layer, batch 1-4 x
# 512-1024 a chip: benchmarks/RESULTS.md, section 14); a frozen head's forward pass takes the rows' gradients
# from the logits it has, and keeps them in float32 and in bf16 (Gemma-3-1B under LoRA: section 17)
LOSS_CHUNK_COPIES = {"trained head": 0.5, "frozen head": 1.5}
# bytes per weight of a frozen nf4 base: 4 bits and a float32 scale per block of 64
NF4_BYTES = 0.5 + 4 / 64
# XLA:TPU's tiles are (8, 128): a tensor's minor dimension is laid out in lanes of 128
LANES = 128


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
    backend: str = "tpu"  # cpu | gpu | tpu: XLA:TPU's lane tiles apply on a TPU only
    mode: str = "full"  # full | lora | qlora
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    optimizer: str = "adamw"  # adamw | adafactor
    mu_dtype: str | None = None  # AdamW's first moment (optim's mu_dtype); None: the weights' dtype
    grad_accum: int = 1
    remat: str = "none"  # none | attention | decoder (Tunix's RematConfig BLOCK / DECODER)
    loss_chunk: int | None = DEFAULT_LOSS_CHUNK  # sft.loss_chunk_size; None: the whole logits (GRPO's update)
    logit_positions: int | None = None  # with loss_chunk None, a row's positions with logits; None: every one

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
    c, p = s.c_bytes, s.p_bytes
    shards = s.fsdp * s.tp  # weights are replicated over the data axis
    matrices = arch.embedding_params + arch.num_layers * arch.layer_matrix_params
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
        optimizer = trainable_dev * (p + (BYTES[s.mu_dtype] if s.mu_dtype else p))
    else:
        optimizer = _adafactor_state(arch, s) if s.mode == "full" else 0.1 * trainable_dev * 4
    if s.grad_accum > 1:
        optimizer += trainable_dev * p  # optax.MultiSteps' gradient accumulator

    activations, logits, one_layer = _kept(arch, s, frozen_bytes)
    # the larger of the forward-backward pass's peak (at the loss) and a layer's backward or the
    # optimizer update's (the gradients, with one layer's working set): XLA reuses the same memory
    peak = params + optimizer + max(activations + logits, grads + one_layer)
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


def forward_layer_bytes(arch: Architecture, setup: TrainSetup) -> float:
    """Per device: one layer's activations at `setup`'s batch and length, what a forward pass without a
    backward (a judge's scoring call) holds at a time; the same count as a layer saves for its backward."""
    return _kept(arch, setup, setup.c_bytes)[2]


def _kept(arch: Architecture, s: TrainSetup, frozen_bytes: float) -> tuple[float, float, float]:
    """(saved for the backward pass by every layer, the loss's buffers, one layer's backward), bytes
    per device, as XLA:TPU keeps them (its buffer assignment for Gemma-2B, Qwen2.5-0.5B and the 7M
    pod model's steps on v5e and v4 topologies; `planning.xla`)."""
    c, tp = s.c_bytes, s.tp
    a = c  # the activations' bytes: every family computes in the compute dtype (Qwen: `run_config`)
    d, f, length = arch.hidden_size, arch.intermediate_size, s.seq_len
    tokens = s.per_device_batch * length  # rows per data-parallel device; tp splits features and heads
    # a layer's activations per token: the gated MLP's gate and up projections and their product
    # (the GELU is recomputed inside the backward's fusion), the inputs and outputs of its two
    # norms, q, k, v and the attention's output, the float32 q and k of Tunix's RoPE, and per
    # attention score only the softmax's output (its backward needs nothing else; in float32 beside
    # the activations' dtype where the family takes the softmax in float32). XLA:TPU lays tensors
    # out in tiles of 128 along their minor dimension: the attention's tensors carry the sequence
    # there, padded to a multiple of 128 (the 7M pod model's 97 tokens take 128)
    padded = math.ceil(length / LANES) * LANES / length
    qkvo = (2 * arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    rope = (arch.num_heads + arch.num_kv_heads) * arch.head_dim * 4
    score = a + (4 if arch.float32_softmax and a < 4 else 0)
    per_head = (qkvo * a + rope + arch.num_heads * length * score) * padded
    one_layer = tokens * ((3 * f + 4 * d) * a + per_head) / tp
    # with fsdp, the backward's matmuls of SFT's full-weight step reuse the forward's all-gather of a
    # layer's weights (remat too: the gather moves ahead of the barrier that guards the recomputation), so
    # every layer keeps its weights gathered until its backward. GRPO's update (Tunix's policy loss, the
    # whole logits) and every LoRA step gather them again there: XLA:TPU keeps two layers' in flight
    # (Gemma-2B's GRPO update, 18 layers; Gemma-3-1B's LoRA SFT, 2 to 26 layers: benchmarks/RESULTS.md, §17)
    gathered = 0.0
    if s.fsdp > 1:
        gathered = arch.layer_matrix_params / tp * (c if s.mode == "full" else frozen_bytes)
    kept_until_backward = s.mode == "full" and s.loss_chunk is not None
    held_per_layer, in_flight = (gathered, 0.0) if kept_until_backward else (0.0, 2 * gathered)
    relaid_per_layer, relaid_at_loss = _relaid_bytes(arch, s, frozen_bytes)
    held_per_layer += relaid_per_layer
    if s.remat == "none":
        activations = arch.num_layers * (one_layer + held_per_layer) + in_flight
    else:  # each block's input only; a layer's backward recomputes its activations after the loss
        kept = (4 if s.remat == "attention" else 1) * tokens * d / tp * a
        activations = arch.num_layers * (kept + held_per_layer) + in_flight
    return activations, _loss_bytes(arch, s, relaid_at_loss), one_layer


def _loss_bytes(arch: Architecture, s: TrainSetup, relaid: float) -> float:
    """The loss's buffers per device on an accelerator: the output head, its gradient and shards (`relaid`: the
    copies XLA:TPU lays out off the lane tile, `_relaid_bytes`), and the logits."""
    c, tp, length = s.c_bytes, s.tp, s.seq_len
    # the output head (all-gathered with fsdp; its gradient is whole until reduce-scattered) and batch x length x
    # vocabulary logits in the compute dtype (XLA:TPU does not split them over tp)
    head = arch.vocab_size * arch.hidden_size * c
    # the head's weight gradient: none for a frozen head (LoRA), the sharded gradient itself with fsdp 1
    gradient_head = head if s.fsdp > 1 and s.mode == "full" else 0.0
    # the head's shards: a trained head's reduce-scattered gradient, kept until the update; a frozen one's two
    # copies of its own shard (Gemma-2-2B's and Gemma-3-1B's LoRA steps, laid out anew for the all-gather)
    if s.mode == "full":
        shards = gradient_head / (s.fsdp * tp)
    else:
        shards = 2 * head / (s.fsdp * tp) if s.fsdp > 1 else 0.0
    shards += relaid
    logits = s.per_device_batch * (s.logit_positions or length) * arch.vocab_size * c
    if not s.loss_chunk:
        # GRPO's update: Tunix's policy loss over the logits of the kept positions (`upstream.completion_logits_only`).
        # XLA:TPU's buffer assignment (Gemma-2B, 18 layers, 1 x 768 tokens a chip, 514 kept) holds the gathered
        # head, its whole gradient, three copies of the logits in the compute dtype (the logits, the completion's
        # slice, its gradient; the float32 log-softmax is fused away) and the gradient's reduce-scattered shard
        loss = head + gradient_head + 3 * logits + shards
    else:
        # `loss.target_logps`: the output layer a chunk of positions at a time, recomputed in the backward
        # pass; the gathered head, its gradient and one chunk's logits
        chunk = s.per_device_batch * min(s.loss_chunk, length) * arch.vocab_size * 4
        copies = LOSS_CHUNK_COPIES["trained head" if s.mode == "full" else "frozen head"]
        loss = head + gradient_head + copies * chunk + shards
    return loss


def _relaid_bytes(arch: Architecture, s: TrainSetup, frozen_bytes: float) -> tuple[float, float]:
    """(per layer, at the loss) bytes per device of the sharded states XLA:TPU lays out anew: none while the hidden
    shard fills whole lanes. Off the lane tile (Qwen2.5-0.5B over fsdp 8: 112 of 896; Gemma-3-1B: 144; Gemma-2-2B:
    288; benchmarks/RESULTS.md, sections 19 and 20):
    - a full-weight step copies every state (weight, AdamW's moments, the accumulator) of the embedding at the loss
      (four 68 MB float32 copies for Qwen, at 3 and 24 layers) and of each layer, counted the same (~17 MB of a
      layer's copies at the peak, and ~23 MB more temporaries a layer than the estimate names); and, unable to
      reduce-scatter the head's gradient in its tiles, it all-reduces the whole and slices its shard: a second
      whole gradient;
    - a LoRA step copies each layer's frozen shard once (a `copy` of every `bf16[288,9216]` or `bf16[144,6912]`
      shard, all 26 layers' live at the peak, in both Kaggle recipes' SFT steps and GRPO updates)."""
    shards = s.fsdp * s.tp
    if s.backend != "tpu" or s.fsdp == 1 or (arch.hidden_size // shards) % LANES == 0:
        return 0.0, 0.0
    if s.mode != "full":
        return arch.layer_matrix_params / shards * frozen_bytes, 0.0
    copies = 1 + (2 if s.optimizer == "adamw" else 0) + (1 if s.grad_accum > 1 else 0)
    second_gradient = arch.vocab_size * arch.hidden_size * s.c_bytes
    return (copies * arch.layer_matrix_params / shards * s.p_bytes,
            second_gradient + copies * arch.embedding_params / shards * s.p_bytes)


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
