"""Where we reach into Tunix, JAX and Kedro: each patch, override or private name, under the heading of its entry in
`docs/upstream_tunix.md` (what the library does, what we do instead, when this code can go).

Fixes to a model's maths live with the model, in `models/families/`; everything that swaps, wraps or reads
Tunix's, JAX's or Kedro's internals at run time lives in this package, so an upgrade is checked in one place:
here, and the sampler's prefill and token choice in `upstream/generation.py` (re-exported here).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import monitoring
from jax.interpreters import pxla
from tunix.rl import common
from tunix.rl.grpo import dapo_learner, drgrpo_learner, grpo_learner
from tunix.sft import peft_trainer
from tunix.sft.dpo import dpo_trainer

from tunix_pipeline.config import GrpoParams
from tunix_pipeline.core.runtime import hand_back_host_memory, shard_rows, step_compiler_options
from tunix_pipeline.tracking.step_metrics import MlflowBackend
from tunix_pipeline.upstream.event_loops import loops_finish_their_tasks  # noqa: F401
from tunix_pipeline.upstream.generation import Sampler, grouped_rollout, in_groups  # noqa: F401
from tunix_pipeline.upstream.jit_options import jit_with_options

REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


# ---------------------------------------------------------------- Loading only from the hub, and only some families
def tunix_key_mapping(params_module, cfg) -> dict:
    """Tunix's checkpoint-key mapping for a family's config (its loader's private `_get_key_and_transform_mapping`),
    which our families reuse and correct where the docs say."""
    return params_module._get_key_and_transform_mapping(cfg)


def tunix_preprocess(params_module, cfg):
    """Tunix's tensor preprocessing for a family's checkpoint (its loader's private `_make_preprocess_fn`)."""
    return params_module._make_preprocess_fn(cfg)


# ---------------------------------------------------------------- `shard_input` replicates a process's rows …
# ---------------------------------------------------------------- The trainer's progress bar: … no throughput
@functools.cache
def trainer_class(base=None):
    """`base` (Tunix's PeftTrainer or a subclass such as DPOTrainer) with four overrides:
    - its jitted steps get `step_compiler_options()` (Tunix's jitted steps take no compiler options);
    - under LoRA its train step takes the frozen weights as an input only (`keep_frozen_weights_in`);
    - each process's rows become one global batch on `data_mesh` before Tunix's `shard_input` sees them;
    - its progress bar shows useful and padded tokens/s once the throughput hook has logged them (the private
      `_tqdm_train_metrics`).
    """
    class Trainer(base or peft_trainer.PeftTrainer):
        data_mesh = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            keep_frozen_weights_in(self)

        def _prepare_inputs(self, batch):
            if self.data_mesh is not None and jax.process_count() > 1 and isinstance(batch, dict):
                batch = shard_rows(batch, self.data_mesh)
            return super()._prepare_inputs(batch)

        @property
        def _tqdm_train_metrics(self):
            names = super()._tqdm_train_metrics
            rates = ("useful_tokens_per_sec", "tokens_per_sec")  # non-padding tokens first, then every slot
            return [*names, *(n for n in rates if self.metrics_logger.metric_exists(self.metrics_prefix, n, "train"))]

        def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False):
            building = not skip_jit and self._jitted_train_step_fn is None
            with jit_with_options(step_compiler_options() if building else {}):
                return super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)

    return Trainer


# ---------------------------------------------------------------- The train step donates the optimizer, not the model
FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # a LoRA model's base weights


def frozen_weights_in_only(train_step, model, optimizer):
    """`train_step(model, optimizer, inputs)` (Tunix's `_train_step`) jitted with the frozen weights as an input only:
    `nnx.jit` returns every variable of the model it is given, so each step wrote a new copy of every frozen weight
    (the whole base model, held twice at the step's peak). The optimizer's state is donated, as Tunix donates it.
    Called as Tunix calls its jitted step: `step(inputs)`, with `step.func.jitted_fn` the compiled function."""
    graph = nnx.graphdef((model, optimizer))

    def step(frozen, opt_state, rest, inputs):
        model, optimizer = nnx.merge(graph, frozen, opt_state, rest)
        out = train_step(model, optimizer, inputs)
        _, _, opt_state, rest = nnx.split((model, optimizer), FROZEN, nnx.optimizer.OptState, ...)
        return out, opt_state, rest

    # the updated state laid out as it came in (an equal layout under another spec is another program: Tunix's own
    # step compiles twice), so one program serves every step
    _, _, opt_state, rest = nnx.split((model, optimizer), FROZEN, nnx.optimizer.OptState, ...)
    layout = jax.tree.map(lambda x: getattr(x, "sharding", None), (opt_state, rest))
    jitted = jax.jit(step, donate_argnums=(1,), out_shardings=(None, *layout))

    def call(inputs):
        _, frozen, opt_state, rest = nnx.split((model, optimizer), FROZEN, nnx.optimizer.OptState, ...)
        out, opt_state, rest = jitted(frozen, opt_state, rest, inputs)
        nnx.update((model, optimizer), opt_state, rest)
        return out

    call.jitted_fn = jitted
    return functools.partial(call)


def keep_frozen_weights_in(trainer) -> None:
    """A LoRA `trainer` (Tunix's PeftTrainer or a subclass: SFT's, DPO's, GRPO's actor, which `RLCluster` builds)
    jits its train step with `frozen_weights_in_only`, under our compiler options."""
    build = trainer.jit_train_and_eval_step

    def jit_train_and_eval_step(skip_jit: bool = False, cache_nnx_graph: bool = False):
        building = not skip_jit and trainer._jitted_train_step_fn is None
        train_step, eval_step = build(skip_jit, cache_nnx_graph)
        if building and trainer._lora_enabled:
            with jit_with_options(step_compiler_options()):
                train_step = trainer._jitted_train_step_fn = frozen_weights_in_only(
                    trainer.create_train_step_fn(), trainer.model, trainer.optimizer)
        return train_step, eval_step

    trainer.jit_train_and_eval_step = jit_train_and_eval_step


def no_anchor_copy(cluster) -> None:
    """Tunix's `RLCluster` keeps a copy of every actor weight in pinned host memory (its "anchor policy", taken when it
    is built and at each `sync_weights`), read only for the old policy's log-probabilities, which its learners ask for
    when `num_iterations > 1`. On a CPU that memory is the devices' own: a second copy of the whole model beside the
    rollouts and the update (1 GiB for Gemma 3 270M). For a run of one iteration a batch it is dropped each time it
    is taken."""
    sync = cluster.sync_weights

    def sync_weights():
        sync()
        cluster._anchor_policy_state = None

    cluster._anchor_policy_state = None
    cluster.sync_weights = sync_weights


def host_memory_back_before_updates(cluster) -> None:
    """On a CPU, each actor update (Tunix's cluster makes one a rollout micro-batch) starts with the host memory the
    rollout freed handed back (`runtime.hand_back_host_memory`): XLA:CPU's buffers are the process's own, and
    glibc keeps what was freed beside the update's temporaries. The GSM8K CPU recipe's update: 3.97 GiB resident
    before it and 13.21 at its peak without, 3.05 and 12.31 with."""
    if jax.default_backend() != "cpu":  # device memory is XLA's own there; a collection each micro-batch costs time
        return
    update = cluster.update_actor

    def update_actor(*args, **kwargs):
        hand_back_host_memory()
        return update(*args, **kwargs)

    cluster.update_actor = update_actor


# ---------------------------------------------------------------- DPO trainer: no SimPO, no precomputed reference …
@functools.cache
def preference_trainer_class(reference_logps):
    """Tunix's DPOTrainer (with `trainer_class`'s overrides) that makes each batch one global array before the
    reference pass, takes precomputed reference log-probabilities (`REFERENCE_COLUMNS`) from the batch, and
    otherwise computes them with `reference_logps(model, example) -> (chosen, rejected)` (Tunix's `compute_logps`
    builds the reference model's whole logits)."""
    reference_pass = nnx.jit(reference_logps)

    class PreferenceTrainer(trainer_class(dpo_trainer.DPOTrainer)):
        def _prepare_inputs(self, batch):
            # the reference model's pass and the concatenation of chosen and rejected rows run on the mesh
            batch = shard_rows(batch, self.data_mesh)
            reference = [batch.pop(c, None) for c in REFERENCE_COLUMNS]
            with_reference, self._ref_model_exists = self._ref_model_exists, False
            try:
                example = super()._prepare_inputs(batch)
            finally:
                self._ref_model_exists = with_reference
            if reference[0] is None and with_reference:
                reference = reference_pass(self.ref_model, example)
            if reference[0] is not None:
                example = example.replace(ref_chosen_logps=reference[0], ref_rejected_logps=reference[1])
            return example

    return PreferenceTrainer


def log_aux_metrics(trainer, names) -> None:
    """The DPO trainer logs the aux metrics named in its private `_aux_metrics_to_log` (set for its own losses);
    ours (SimPO, RPO, ORPO on means) return theirs through the loss hook."""
    trainer._aux_metrics_to_log = {name: np.mean for name in names}


# ---------------------------------------------------------------- The last step's loss is written one step late
def record_history_with_checkpoints(trainer, write_history) -> None:
    """`write_history(step)` after each checkpoint the trainer saves (wraps its manager's `save`), so a killed run's
    loss curve survives with its checkpoint, including the step Tunix has not written yet."""
    manager = trainer.checkpoint_manager
    save = manager.save

    def save_and_record(step, *args, **kwargs):
        saved = save(step, *args, **kwargs)
        if saved:
            write_history(step)
        return saved

    manager.save = save_and_record


def pending_loss(trainer) -> float | None:
    """The last step's loss, which Tunix keeps in a private buffer until the next step."""
    pending = getattr(trainer, "_prev_buffered_train_metrics", None)
    return None if pending is None else float(pending.loss)


# ---------------------------------------------------------------- GRPO: a closed trainer keeps logging …
@contextlib.contextmanager
def scalar_listeners_scope():
    """Scalar listeners added inside are removed on exit; stale MLflow ones from earlier stages before.

    Tunix's `MetricsLogger.close()` calls `jax.monitoring.clear_event_listeners()`, which in jax 0.10 forgets
    scalar listeners (it assigns a local `_scalar_listeners`), so a closed trainer's backend keeps receiving
    every later metric: SFT's MLflow backend would log each GRPO metric a second time.
    """
    def listeners():
        return list(monitoring.get_scalar_listeners())

    for listener in listeners():
        if isinstance(getattr(listener, "__self__", None), MlflowBackend):
            jax.monitoring.unregister_scalar_listener(listener)
    before = listeners()
    try:
        yield
    finally:
        for listener in listeners():
            if listener not in before:
                jax.monitoring.unregister_scalar_listener(listener)


# ---------------------------------------------------------------- GRPO: the rollout samples with the same key every step
def move_rollout_seed(rollout_config, seed: int) -> None:
    """Tunix's rollout samples with `RolloutConfig.seed` on every call; set before each batch, steps draw afresh."""
    rollout_config.seed = seed


# ---------------------------------------------------------------- DAPO: reference log-probs without a KL term, …
def algorithm(params: GrpoParams):
    """(Tunix algorithm config, learner class) for `grpo.loss_variant`, chosen by name as Tunix's own
    `function_registry` chooses losses."""
    common = dict(num_generations=params.num_generations, num_iterations=params.num_iterations, epsilon=params.epsilon)
    if params.loss_variant == "grpo":
        return grpo_learner.GRPOConfig(beta=params.beta, **common), grpo_learner.GRPOLearner
    if params.loss_variant == "dr-grpo":
        return drgrpo_learner.DrGRPOConfig(beta=params.beta, **common), drgrpo_learner.DrGRPOLearner
    epsilon_high = params.epsilon_high if params.epsilon_high is not None else 0.28
    return dapo_config(epsilon_high, **common), dapo_learner.DAPOLearner


def dapo_config(epsilon_high: float, **common):
    """Tunix's `DAPOConfig` without the overlong shaping (it counts characters; the `length_penalty` reward is the
    knob) and with `beta = 0.0`: Tunix computes reference log-probs whenever `beta != 0.0`, true for DAPO's None,
    and 0.0 means the same to the loss without that pass or a reference model."""
    config = dapo_learner.DAPOConfig(epsilon_high=epsilon_high, overlong_buffer=None, **common)
    config.beta = 0.0
    return config


# ---------------------------------------------------------------- The output layer runs inside a model's call, at every position
def decoder_models() -> tuple[type, ...]:
    """Tunix's model classes whose `__call__` ends `final_norm`, then per-position steps only."""
    classes = {"gemma": "Gemma", "gemma3": "Gemma3", "llama3": "Llama3", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    return tuple(getattr(importlib.import_module(f"tunix.models.{m}.model"), c) for m, c in classes.items())


class KeepsHidden(nnx.Module):
    """A final norm that keeps its output, the decoder's last hidden states, and passes on none of its positions:
    the model's own output layer then runs over zero positions."""

    def __init__(self, norm):
        self.norm = norm

    def __call__(self, x):
        hidden = self.norm(x)
        self.hidden = nnx.Intermediate(hidden)
        return hidden[:, :0]


def decoder_and_output_layer(model):
    """`(decoder, output_layer, head)` of one of `decoder_models()` (ours subclass them), None for other models.
    `decoder(tokens, positions, attention_mask)` gives the final norm's output at every position;
    `output_layer(head, hidden)` the float32 logits the model's call computes from it (the tied embedding or
    `lm_head`, the final soft-cap), with `head` that module's state as an argument, so a loss can run the output
    layer where and when it chooses and differentiate it itself."""
    if not isinstance(model, decoder_models()):
        return None
    graphdef, state = nnx.split(model)
    body = nnx.merge(graphdef, state)  # a copy that shares the arrays: the caller's model keeps its norm
    body.final_norm = KeepsHidden(body.final_norm)
    config = model.config
    tied = getattr(config, "weight_tying", getattr(config, "use_tied_embedding", True))
    cap = getattr(config, "final_logit_softcap", None)
    head_graph, head = nnx.split(body.embedder if tied else body.lm_head)

    def decoder(tokens, positions, attention_mask):
        body(tokens, positions, None, attention_mask)
        return body.final_norm.hidden[...]

    def output_layer(head, hidden):
        module = nnx.merge(head_graph, head)
        logits = (module.decode(hidden) if tied else module(hidden)).astype(jnp.float32)
        return jnp.tanh(logits / cap) * cap if cap is not None else logits

    return decoder, output_layer, head


# ---------------------------------------------------------------- GRPO: log-probs run the output layer at every prompt position
class LastPositions(nnx.Module):
    """A final norm over the last `n` positions only: what follows it in our models is per position."""

    def __init__(self, norm, n: int):
        self.norm, self.n = norm, n

    def __call__(self, x):
        return self.norm(x[:, -self.n:])


@contextlib.contextmanager
def completion_logits_only():
    """Within this block, Tunix's `compute_per_token_logps` (GRPO's loss, reference and old-policy log-probs) runs
    the output layer only at the completion's positions and the two prompt positions before them (the last one's
    logits are the first it keeps): same log-probs and gradients, no (batch, prompt, vocabulary) logits. Exact for Tunix's Gemma, Gemma 3, Llama 3
    and Qwen 2/3 (ours subclass them), whose `__call__` ends `final_norm`, then per-position steps only (output
    layer, softcap, cast); other models take Tunix's path."""
    models = decoder_models()
    original = common.compute_per_token_logps

    def compute_per_token_logps(graphdef, state, prompt_tokens, completion_tokens, *args, **kwargs):
        model = nnx.merge(graphdef, state)  # a copy: the caller's model keeps its norm
        if isinstance(model, models):  # a packed row is shorter than the slice, and kept whole
            # one position more than Tunix's `logits[:, -n - 1:-1]` reads: as a prefix of the kept positions that
            # slice is a bitcast XLA:TPU miscompiles ("Bitcast cannot have different shape sizes"; Gemma 3 1B,
            # 320-token completions, v5e 2x4)
            model.final_norm = LastPositions(model.final_norm, completion_tokens.shape[1] + 2)
            graphdef, state = nnx.split(model)
        return original(graphdef, state, prompt_tokens, completion_tokens, *args, **kwargs)

    common.compute_per_token_logps = compute_per_token_logps
    try:
        yield
    finally:
        common.compute_per_token_logps = original


# ---------------------------------------------------------------- Tunix's models drop their sharding constraints on a CPU host
# where each family finds its `shard`: Gemma, Llama and Qwen define their own; Gemma 3 calls `sharding_utils.shard`
# (without it the plan compiled Gemma 3's layers with the batch gathered on every chip: 4.1 GiB at 2 layers for 1.7)
SHARD_MODULES = (
    "tunix.models.gemma.model",
    "tunix.utils.sharding_utils",
    "tunix.models.llama3.model",
    "tunix.models.qwen2.model",
    "tunix.models.qwen3.model",
)


@contextlib.contextmanager
def accelerator_sharding(platform: str = "tpu"):
    """Tunix's `shard(x, spec)` applies its sharding constraint on the CPU too, while this is active, for a run on
    `platform` "tpu" or "gpu" (the plan compiles for a TPU topology, or stands the CPU in for a GPU, from a CPU host,
    and the program must carry the run's constraints); for a run on "cpu" nothing changes: it drops them."""
    if platform == "cpu":
        yield
        return
    def shard(x, spec, eager=False):  # `sharding_utils.shard` may also be asked to place an array now (eager)
        mesh = pxla.thread_resources.env.physical_mesh
        if mesh.empty:
            return x
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return jax.device_put(x, sharding) if eager else jax.lax.with_sharding_constraint(x, sharding)

    patched = []
    for name in SHARD_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "shard"):
            patched.append((module, module.shard))
            module.shard = shard
    try:
        yield
    finally:
        for module, original in patched:
            module.shard = original


# ---------------------------------------------------------------- Kedro's file datasets write in place
def atomic_saves(dataset) -> None:
    """Make a local, unversioned Kedro file dataset write to a hidden sibling and rename it into place, so a run
    killed mid-save leaves the old output or none, never a truncated file that `--only-missing-outputs` would take
    for a finished one. Other datasets (memory, versioned, object stores, whose uploads land whole) are left as
    they are; calling it twice is harmless."""
    if getattr(dataset, "_protocol", None) != "file" or getattr(dataset, "_version", None) or "save" in vars(dataset):
        return
    save = dataset.save

    def atomic_save(data) -> None:
        original = dataset._filepath
        target = Path(original)
        partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
        dataset._filepath = type(original)(partial)  # what the dataset's save writes to (`_get_save_path`)
        try:
            save(data)
            if partial.is_dir() and target.exists():  # a folder output (partitioned parquet, several figures)
                _remove(target)
            os.replace(partial, target)
        finally:
            dataset._filepath = original
            if partial.exists():
                _remove(partial)

    dataset.save = atomic_save


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()
