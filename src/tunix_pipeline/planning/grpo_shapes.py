"""GRPO's two programs on a profile: the rollout (the whole batch x G completions decoded together) and the
update (a micro-batch's sequences, accumulated), as `TrainSetup`s, and what one decode step holds. The plan
(`planning.grpo`) and its XLA check (`planning.grpo_xla`) both size from these."""

from __future__ import annotations

from tunix_pipeline.config import GrpoParams
from tunix_pipeline.models.architecture import Architecture
from tunix_pipeline.planning.decode import kv_cache_bytes
from tunix_pipeline.planning.memory import NF4_BYTES, TrainSetup, estimate_memory
from tunix_pipeline.planning.plan import Row


def sequences_per_device(grpo: GrpoParams, setup: TrainSetup, prompts: int | None = None) -> int:
    """Completions a device holds: `prompts` (the batch) x G split over the data-parallel devices (whole when it
    does not divide)."""
    sequences = (prompts or grpo.batch_size) * grpo.num_generations
    dp = setup.data * setup.fsdp
    return sequences // dp if sequences % dp == 0 else sequences


def micro_batches(grpo: GrpoParams) -> int:
    """The update's micro-batches a step (gradients accumulated): batch / micro_batch_size, else 1."""
    return grpo.batch_size // grpo.micro_batch_size if grpo.micro_batch_size else 1


def update_setup(row: Row, grpo: GrpoParams) -> TrainSetup:
    """The policy's train step on this profile: micro-batch (else batch) x G sequences of prompt + completion
    tokens, accumulated over the micro-batches; the output layer at the completion's positions and the two
    prompt positions before them only (`upstream.completion_logits_only`), whole."""
    return row.setup.replace(per_device_batch=sequences_per_device(grpo, row.setup, grpo.micro_batch_size),
                             seq_len=grpo.max_prompt_length + grpo.max_completion_length,
                             grad_accum=micro_batches(grpo), loss_chunk=None,
                             logit_positions=grpo.max_completion_length + 2, optimizer=grpo.optimizer,
                             mu_dtype=grpo.mu_dtype)


def rollout_setup(row: Row, grpo: GrpoParams) -> TrainSetup:
    """The rollout on this profile: the whole batch x G sequences decoded together."""
    return update_setup(row, grpo).replace(per_device_batch=sequences_per_device(grpo, row.setup), grad_accum=1)


def decode_program_bytes(arch: Architecture, setup: TrainSetup, sequences: int) -> float:
    """Per device: what one decode step holds: the policy (once), every weight all-gathered, the KV cache and a
    step's float32 logits. The gathered weights are the conservative case: XLA:TPU gathers the whole fsdp-sharded
    model for Gemma-2-2B's decode step on a v5e 2x4 (0.17 GiB more a layer; -21% at 3 layers), but not for
    Gemma-3-1B's (0.48 GiB against 2.2 estimated), where it splits the matmuls instead."""
    m = estimate_memory(arch, setup)
    frozen = NF4_BYTES if setup.mode == "qlora" else setup.c_bytes
    gathered = (arch.embedding_params + arch.num_layers * arch.layer_matrix_params) * frozen / setup.tp if setup.fsdp > 1 else 0.0
    return (m.params - m.grads + gathered + kv_cache_bytes(arch, setup, sequences, setup.seq_len)
            + sequences * arch.vocab_size * 4)
