"""GRPO's two programs compiled ahead of time for a TPU topology (libtpu's compile-only devices, or an
attached TPU), or for this CPU when the run is planned on it: abstract shapes, no weights, no TPU needed.

- **generation**: one decode step of Tunix's sampler: the model's forward pass over the last token of
  every completion with the KV cache (`Sampler._sample_step`, the cache donated as Tunix donates it),
  at the rollout's shapes: batch x G sequences, a cache of prompt + completion positions, the
  policy sharded as the trainer shards it (the rollout uses the actor's model on the same mesh), or
  whole on each data-parallel chip with `runtime.decode_weights: gathered` (the sampler gathers it once
  a call: `generation.gathers_weights`); the cache is split over the data-parallel axes as the
  model's activations are.
- **update**: the actor's train step (one micro-batch's, with `grpo.micro_batch_size`), the run's own
  program: Tunix's `PeftTrainer._train_step` with the registered policy loss for `grpo.loss_variant`
  (`GRPOLearner`'s `loss_fn`, its logged metrics kept) on a `TrainExample` carrying the reference's and, with
  `num_iterations > 1`, the old policy's log-probabilities, its gradient with respect to what is trained (the
  LoRA adapters, or every weight) and `make_optimizer`'s update (accumulated over the micro-batches), jitted as
  the run jits it, optimizer state donated.

`memory_analysis()` gives the bytes per chip and `cost_analysis()` the FLOPs and the bytes accessed per
chip (the decode step's roofline: `planning.grpo`). A deep model's decode step is compiled at two and three
layer periods and extrapolated, as `planning.xla` does for SFT's step (one layer is a period when every sliding
window spans the rollout: `layer_period`); the update at full depth.
"""

from __future__ import annotations

import functools
import re
import time
import types

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from tunix.generate import sampler as tunix_sampler
from tunix.rl import function_registry
from tunix.rl.grpo.grpo_learner import TrainExample
from tunix.sft import peft_trainer

from tunix_pipeline.config import GrpoParams, JudgeParams
from tunix_pipeline.core.runtime import BATCH_AXES, whole_over_batch
from tunix_pipeline.models.architecture import Architecture
from tunix_pipeline.planning import compiled_figures, judge, xla
from tunix_pipeline.planning import judge as judge_lib
from tunix_pipeline.planning.grpo_shapes import decode_program_bytes, micro_batches, rollout_setup, update_setup
from tunix_pipeline.planning.memory import GIB, TrainSetup, estimate_memory
from tunix_pipeline.planning.xla import abstract, abstract_policy, measure
from tunix_pipeline.train.loop import make_optimizer
from tunix_pipeline.upstream import (FROZEN, accelerator_sharding, algorithm, completion_logits_only,
                                     frozen_weights_in_only)


def _rows(mesh, sequences: int, shape: tuple, dtype):
    """An abstract batch-major array split over the data-parallel axes when the rows divide them."""
    dp = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    spec = jax.sharding.PartitionSpec(*BATCH_AXES) if sequences % dp == 0 else jax.sharding.PartitionSpec()
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))


def compile_decode_step(arch: Architecture, setup: TrainSetup, grpo: GrpoParams, layers: int, lora, devices,
                        gathered: bool = False) -> dict:
    """One decode step with the KV cache at the rollout's shapes: memory, FLOPs and bytes accessed per chip;
    `gathered`: the weights whole on each data-parallel chip."""
    started = time.perf_counter()
    mesh, model, _, _ = abstract_policy(arch, setup, layers, lora, devices)
    graph, state = nnx.split(model)
    state = abstract(state, mesh)
    if gathered:
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole_over_batch(x)), state)
    sequences = grpo.batch_size * grpo.num_generations
    cache_size = grpo.max_prompt_length + grpo.max_completion_length
    dtype = jnp.dtype(setup.c_dtype)
    if hasattr(model, "init_cache"):  # as Tunix's sampler makes it
        cache = jax.eval_shape(lambda: model.init_cache(sequences, cache_size, dtype))
    else:
        cache = jax.eval_shape(lambda: tunix_sampler._init_cache(  # noqa: SLF001 - the sampler's own fallback
            layers, cache_size, sequences, arch.num_kv_heads, arch.head_dim, dtype))
    cache = jax.tree.map(lambda x: _rows(mesh, sequences, x.shape, x.dtype), cache)

    def decode(state, cache, tokens, positions, mask):  # Sampler._sample_step's forward pass
        logits, cache = nnx.merge(graph, state)(tokens, positions=positions, cache=cache, attention_mask=mask)
        return logits, cache

    with accelerator_sharding(devices[0].platform), mesh:
        lowered = jax.jit(decode, donate_argnums=(1,)).lower(
            state, cache, _rows(mesh, sequences, (sequences, 1), jnp.int32),
            _rows(mesh, sequences, (sequences, 1), jnp.int32), _rows(mesh, sequences, (sequences, 1, cache_size), jnp.bool_),
        )
        return measure(lowered, started, layers, devices, "GRPO's decode step")


def compile_update_step(arch: Architecture, setup: TrainSetup, grpo: GrpoParams, layers: int, lora, devices) -> dict:
    """The actor's GRPO train step at batch x G sequences of prompt + completion tokens, bytes and FLOPs per chip."""
    started = time.perf_counter()
    return measure(lower_update_step(arch, setup, grpo, layers, lora, devices), started, layers, devices,
                   "GRPO's update")


def lower_update_step(arch: Architecture, setup: TrainSetup, grpo: GrpoParams, layers: int, lora, devices):
    """The run's update program, lowered on abstract shapes: Tunix's own `PeftTrainer._train_step` with
    `GRPOLearner`'s loss, so it keeps what the run's keeps (the loss's logged metrics, the token entropy over the
    whole vocabulary among them, and the gradient's norm), the optimizer wrapped for accumulation as Tunix wraps it
    when the update is split into micro-batches, the frozen weights an input only (`upstream.frozen_weights_in_only`)."""
    tx = make_optimizer(grpo, grpo.max_steps)
    if grpo.micro_batch_size:  # RLCluster sets mini_batch_size // train_micro_batch_size steps, PeftTrainer wraps
        tx = optax.MultiSteps(tx, micro_batches(grpo))
    mesh, model, optimizer, wrt = abstract_policy(arch, setup, layers, lora, devices, tx)
    nnx.update((model, optimizer), abstract(nnx.state((model, optimizer)), mesh))  # sharded as the trainer's
    algo_config, _ = algorithm(grpo)
    algo_config.temperature = grpo.temperature  # as GRPOLearner sets it from the rollout config
    policy_loss = function_registry.get_policy_loss_fn(algo_config.policy_loss_fn)
    # what GRPOLearner gives its actor's trainer (`with_loss_fn`, `with_gen_model_input_fn`); the trainer's own
    # state is not read by the step
    trainer = types.SimpleNamespace(
        loss_fn=lambda model, train_example, algo_config: policy_loss(
            model, train_example, algo_config=algo_config, pad_id=0, eos_id=1),
        gen_model_input_fn=lambda x: {"train_example": x, "algo_config": algo_config},
        _has_aux=True, _lora_enabled=wrt is nnx.LoRAParam,
    )
    # one micro-batch (grpo.micro_batch_size) when the update is split; the whole batch otherwise
    s = (grpo.micro_batch_size or grpo.batch_size) * grpo.num_generations
    p, c = grpo.max_prompt_length, grpo.max_completion_length
    logps = _rows(mesh, s, (s, c), jnp.float32)
    example = TrainExample(
        prompt_ids=_rows(mesh, s, (s, p), jnp.int32), prompt_mask=_rows(mesh, s, (s, p), jnp.bool_),
        completion_ids=_rows(mesh, s, (s, c), jnp.int32), completion_mask=_rows(mesh, s, (s, c), jnp.bool_),
        advantages=_rows(mesh, s, (s,), jnp.float32),
        ref_per_token_logps=logps if algo_config.beta else None,
        old_per_token_logps=logps if grpo.num_iterations > 1 else None,
    )

    step = functools.partial(peft_trainer.PeftTrainer._train_step, trainer)  # noqa: SLF001 - Tunix's step body
    # GRPO's programs compile for this CPU only to plan a run on it (`xla.compile_target`): without the sharding
    # constraints a CPU run drops
    with accelerator_sharding(devices[0].platform), completion_logits_only(), mesh:  # as `grpo.train_grpo` runs it
        if trainer._lora_enabled:  # jitted as the run jits it
            jitted = frozen_weights_in_only(step, model, optimizer).func.jitted_fn
            return jitted.lower(*nnx.split((model, optimizer), FROZEN, nnx.optimizer.OptState, ...)[1:], example)
        return nnx.jit(step, donate_argnames=("optimizer",)).lower(model, optimizer, example)  # Tunix's own jit


def compile_judge_call(arch: Architecture, setup: TrainSetup, judge: JudgeParams, layers: int, devices) -> dict:
    """A judge's scoring call: its forward over batch_size rubrics of max_prompt_length tokens on its devices (no
    cache), the last position's logits only, bytes, FLOPs and bytes accessed per chip."""
    started = time.perf_counter()
    mesh, model, _, _ = abstract_policy(arch, setup, layers, None, devices)
    graph, state = nnx.split(model)
    seqs, length = judge.batch_size, judge.max_prompt_length

    def score(state, tokens, positions, mask):
        judge_model = nnx.merge(graph, state)
        if not hasattr(judge_model, "embedder"):  # no separate head to apply: the whole logits, sliced
            logits, _ = judge_model(tokens, positions=positions, cache=None, attention_mask=mask)
            return logits[:, -1].astype(jnp.float32)
        # the final hidden states (Tunix sows them), the head on the last position only; the whole logits are dead
        # code XLA drops (slicing them instead keeps batch x length x vocabulary: 2.7x the 4B judge's memory)
        judge_model(tokens, positions=positions, cache=None, attention_mask=mask, output_hidden_states=True)
        (hidden,) = nnx.state(judge_model, nnx.Intermediate)["all_hidden_states"].value
        return judge_model.embedder.decode(hidden[:, -1]).astype(jnp.float32)

    with accelerator_sharding(), mesh:
        lowered = jax.jit(score).lower(
            abstract(state, mesh), _rows(mesh, seqs, (seqs, length), jnp.int32),
            _rows(mesh, seqs, (seqs, length), jnp.int32), _rows(mesh, seqs, (seqs, length, length), jnp.bool_),
        )
        return measure(lowered, started, layers, devices, "the judge's scoring call")


def check_judges(plan, policy, grpo: GrpoParams, arches: dict, devices, max_layers: int | None) -> dict:
    """Each judge's scoring call compiled for the topology: on the last `judge.devices` chips, or time-shared on
    the policy's (`policy`: its row); the estimate of that program beside it."""
    n, out = judge_lib.sub_mesh(grpo), {}
    for name, j in judge_lib.judge_rewards(grpo):
        arch = arches[name]
        setup = judge_lib.judge_setup(j, policy.setup, n if j.devices else None)
        chips = devices[-n:] if j.devices else devices[: policy.hw.devices]
        b = judge_lib.scoring_bytes(arch, j, setup)
        estimate = b["weights"] + b["working"] - b["kv_cache"]  # the compiled call is the prefill, without a cache
        out[name] = _compiled(lambda layers: compile_judge_call(arch, setup, j, layers, chips), arch, max_layers,
                              layer_period(arch, j.max_prompt_length), estimate)
    return out


def layer_period(arch: Architecture, length: int) -> int:
    """Layers after which the program repeats: 1 when every sliding window spans the whole sequence (Gemma 2 and
    3's local layers then compute what the global ones do, masked alike), else the model's own period."""
    window = arch.hf_config.get("sliding_window")
    return 1 if window and window >= length else max(arch.layer_period, 1)


def whole_model(compile_at, arch: Architecture, max_layers: int | None, period: int = 1) -> dict:
    """`compile_at(layers)` for the whole model, or at two and three layer periods extrapolated to every layer
    (XLA:TPU schedules a model's first layer unlike the others: see `xla.xla_peak`)."""
    first = 2 * period
    if max_layers is None or arch.num_layers <= max(max_layers, first + period):
        full = compile_at(arch.num_layers)
        return {**full, "method": compiled_figures.method(f"compiled all {arch.num_layers} layers", full)}
    a, b = compile_at(first), compile_at(first + period)
    periods = (arch.num_layers - first) / period
    return {
        "peak": a["peak"] + periods * (b["peak"] - a["peak"]),
        "flops": a["flops"] + periods * (b["flops"] - a["flops"]),
        "bytes_accessed": a["bytes_accessed"] + periods * (b["bytes_accessed"] - a["bytes_accessed"]),
        "seconds": a["seconds"] + b["seconds"],
        "platform": a["platform"],
        "method": compiled_figures.method(f"compiled {first} and {first + period} layers, extrapolated to {arch.num_layers}",
                                          a, b),
    }


def estimates(arch: Architecture, setup: TrainSetup, roll: TrainSetup | None = None) -> dict:
    """The analytic bytes of the very programs compiled: the decode step (the rollout's `roll`, else `setup`'s
    sequences) and the train step (one micro-batch)."""
    roll = roll or setup.replace(grad_accum=1)
    return {"generation": decode_program_bytes(arch, roll, roll.per_device_batch),
            "update": estimate_memory(arch, setup.replace(grad_accum=1)).peak}


def check(plan, model, grpo: GrpoParams, max_layers: int | None = 4, params=None,
          decode_weights: str = "sharded") -> dict | None:
    """Both GRPO programs of the selected profile compiled by XLA:TPU for its topology (or the attached TPU), and
    each judge's scoring call (`params`: the PlanParams that find the judges and resize the policy's mesh;
    `decode_weights`: `runtime.decode_weights`); None when neither libtpu nor a TPU is at hand. A program that
    does not compile is reported as such."""
    try:
        target = xla.compile_target(plan.selected.hw)
    except Exception as err:  # noqa: BLE001 - e.g. a topology libtpu does not know: the estimate stands
        return {"error": f"{type(err).__name__}: {err}", "topology": plan.selected.hw.topology}
    if target is None:
        return None
    name, devices = target
    compiler = f"XLA:{devices[0].platform.upper()}"
    arch, policy = plan.job.arch, plan.selected
    arches = judge.architectures(grpo, params) if params is not None else {}
    if arches:  # with a judge on its own chips, the policy's programs are compiled on the others
        policy, problem = judge.policy_row(plan, plan.selected, grpo, params)
        if problem:
            return {"error": problem, "topology": name}
    setup = update_setup(policy, grpo)
    estimate = estimates(arch, setup, rollout_setup(policy, grpo))
    out = {"topology": name, "compiler": compiler, "mesh": setup.mesh, "dtype": setup.param_dtype,
           "decode_weights": decode_weights}
    decode_step = functools.partial(compile_decode_step, gathered=decode_weights == "gathered")
    # the update is compiled at full depth: XLA:TPU schedules a shallow one into less than its layers add up to
    # (Gemma-2B's, one 768-token sequence a chip: 2.56 and 2.61 GiB at 2 and 3 layers, 5.35 at all 18 against
    # 3.38 extrapolated), where the decode step's memory grows by a layer's each layer
    for phase, compile_fn, depth in (("generation", decode_step, max_layers), ("update", compile_update_step, None)):
        out[phase] = _compiled(lambda layers: compile_fn(arch, setup, grpo, layers, model.lora, devices), arch,
                               depth, layer_period(arch, setup.seq_len), estimate[phase])
    if arches and compiler == "XLA:TPU":
        out["judges"] = check_judges(plan, policy, grpo, arches, devices, max_layers)
    return out


def _compiled(compile_at, arch: Architecture, max_layers: int | None, period: int, estimate: float) -> dict:
    """One program compiled for the whole model (`whole_model`), beside `estimate` (bytes per chip); a program
    XLA:TPU refuses for memory, or that does not compile, is reported as such."""
    try:
        r = whole_model(compile_at, arch, max_layers, period)
    except Exception as err:  # noqa: BLE001 - a sharding error, an unsupported op: the program itself fails
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        needed = re.search(r"Ran out of memory.*?\(([\d.]+)G\) exceeds", message)
        return ({"error": message, "out_of_memory": True, "xla_gib": float(needed.group(1)),
                 "method": "refused by XLA:TPU", "seconds": 0.0, "flops_per_device": None,
                 "bytes_accessed_per_device": None, "estimate_gib": estimate / GIB, "difference": None} if needed
                else {"error": f"{type(err).__name__}: {message}", "does_not_compile": True})
    return {
        "method": r["method"],
        "seconds": r["seconds"],
        "xla_gib": r["peak"] / GIB,
        "flops_per_device": r["flops"],
        "bytes_accessed_per_device": r["bytes_accessed"],
        "estimate_gib": estimate / GIB,
        "difference": (estimate - r["peak"]) / r["peak"],
    }
