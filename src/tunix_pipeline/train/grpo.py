"""GRPO polish with Tunix's `RLCluster` + `GRPOLearner` (vanilla rollout), from the SFT checkpoint.

What we add around Tunix, through its own seams:
- prompts that fit `max_prompt_length` (longer ones are skipped and counted), fed in
  seeded, reproducible batches as numpy arrays (a Python list would be split by
  Tunix's `jax.tree.map`), so a resumed run continues with the same data;
- weighted, pluggable rewards (`rewards.RewardSet`) and their per-step mean and
  spread as metrics; everything Tunix logs reaches MLflow through our metrics backend;
- a frozen reference copy of the SFT policy for the KL term (none when beta is 0);
  it shares the actor's arrays until the actor changes them, so with LoRA the
  base weights are held once;
- a new sampling seed per step (Tunix's rollout otherwise reuses one key every step);
- checkpoints every `checkpoint_every` steps and at the last step (with Tunix's
  step metadata), resumed automatically, and a reward/KL history kept beside them;
- with `grpo.dev_eval`, the dev split scored every N steps and the best step kept (`dev_eval`);
- with `grpo.prompt_filter`, only the prompts the starting policy solves some of the time (`filtered_prompts`).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass

import jax
import numpy as np
import pandas as pd
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout

from tunix_pipeline import upstream
from tunix_pipeline.config import EvaluateParams, GrpoParams
from tunix_pipeline.core import progress
from tunix_pipeline.core.errors import TrainingInterrupted, UserError
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.core.processes import barrier
from tunix_pipeline.core.runtime import BATCH_AXES, data_parallel_size
from tunix_pipeline.generate.generation import (
    Generator, end_tokens, fitting_prompts, gathers_weights, prompt_key, sampling_args,
)
from tunix_pipeline.stages import StageResult
from tunix_pipeline.train import checkpoints
from tunix_pipeline.train.loop import frozen_copy, make_optimizer, stop_on_signals
from tunix_pipeline.train.rewards import REWARD_COLUMNS, RewardSet
from tunix_pipeline.train.skips import NothingToLearn

log = logging.getLogger(__name__)
HISTORY_FILE = "grpo_history.json"
FILTER_FILE = "prompt_filter.json"  # the screen's scores (`filtered_prompts`), beside the checkpoints
SCREEN_PART_BATCHES = 8  # `screen_part`


class GrpoError(UserError, ValueError):
    """A GRPO set-up that cannot run (a batch that does not divide the mesh, ...)."""


# ---------------------------------------------------------------- data
def prompt_pool(rows: pd.DataFrame, max_prompts: int | None, seed: int) -> pd.DataFrame:
    """A seeded sample of `max_prompts` rows (all of them when None or when there are no more)."""
    if max_prompts is None or len(rows) <= max_prompts:
        return rows
    return rows.sample(n=max_prompts, random_state=seed).reset_index(drop=True)


class PromptFeed:
    """Seeded epochs of full prompt batches; batch `i` is the same in every run (resume replays the order).

    Each batch also moves the rollout's sampling seed on, so steps draw fresh samples. A stop signal
    (`loop.stop_on_signals`) ends it: Tunix's learner then saves the step it reached and closes.
    """

    def __init__(self, rows: pd.DataFrame, batch_size: int, seed: int, rollout_config=None):
        if len(rows) < batch_size:
            raise GrpoError(f"{len(rows)} prompts cannot fill one GRPO batch of {batch_size}; lower `grpo.batch_size`")
        self.columns = {"prompts": rows["prompt"].astype(str).to_numpy()}
        for key, column in REWARD_COLUMNS.items():
            if column in rows:
                self.columns[key] = rows[column].astype(str).to_numpy()
        self.batch_size, self.seed, self.rollout_config = batch_size, seed, rollout_config
        self.stop_reason: str | None = None

    def stop(self, reason: str) -> None:
        self.stop_reason = reason

    @property
    def interrupted(self) -> bool:
        return self.stop_reason is not None

    def __iter__(self):
        n = len(self.columns["prompts"])
        rng = np.random.default_rng(self.seed)
        step = 0
        while True:
            order = rng.permutation(n)
            for start in range(0, n - self.batch_size + 1, self.batch_size):
                if self.stop_reason:
                    return
                idx = order[start : start + self.batch_size]
                if self.rollout_config is not None:
                    upstream.move_rollout_seed(self.rollout_config, self.seed * 1_000_003 + step)
                step += 1
                yield {k: v[idx] for k, v in self.columns.items()}


# ---------------------------------------------------------------- the run
@dataclass(frozen=True)
class GrpoInputs:
    """What GRPO checked before any weights load (`prepare`), as `train_grpo` uses it."""

    prompts: pd.DataFrame  # the training prompts that fit `grpo.max_prompt_length`, at most `grpo.max_prompts`
    too_long: int  # how many did not fit
    rewards: RewardSet  # its judge, if any, loads on first use


def prepare(train_formatted: pd.DataFrame, tokenizer, params: GrpoParams, mesh: jax.sharding.Mesh,
            judge_mesh: jax.sharding.Mesh | None = None) -> GrpoInputs:
    """GRPO's checks before any weights load: the rewards resolve (judges on `judge_mesh`, else `mesh`), a batch
    divides the mesh (`GrpoError`), enough prompts fit (`NothingToLearn`)."""
    rewards = RewardSet(params.rewards, judge_mesh or mesh)
    prompts, too_long = training_prompts(train_formatted, tokenizer, params, mesh)
    return GrpoInputs(prompts, too_long, rewards)


def train_grpo(
    model, tokenizer, inputs: GrpoInputs, params: GrpoParams, mesh: jax.sharding.Mesh,
    metrics_backends: list | None = None, decode_weights: str = "sharded", dev=None,
) -> StageResult:
    """GRPO on `model` in place (full weights or LoRA adapters) from `prepare`'s inputs; resumes.
    `decode_weights`: the rollouts', `runtime.decode_weights`; `dev`: a `dev_eval.DevEval` (`grpo.dev_eval`) scoring
    the dev split as it goes and keeping the best step, or None."""
    rows, rewards = inputs.prompts, inputs.rewards
    root = storage_path(params.checkpoint_dir)  # a gs:// URI reaches Orbax as it is
    screen = None
    if params.prompt_filter is not None:  # sampled from the starting policy, before a GRPO checkpoint restores
        rows, screen = filtered_prompts(model, tokenizer, rows, rewards, params, mesh, root, decode_weights)
    rollout = _rollout_config(params, tokenizer)
    algo_config, learner_cls = upstream.algorithm(params)
    cluster_config = _cluster_config(params, mesh, root, checkpoints.logger_options(root, metrics_backends), rollout,
                                     gathers_weights(decode_weights, model), dev)
    # the reference is the SFT policy as it is now, before any GRPO checkpoint is restored into the actor
    reference = frozen_copy(model) if algo_config.beta else None
    # `with mesh:` and not `jax.set_mesh`: under the latter Tunix's optimizer sharding step fails;
    # log-probs make logits at the completion's positions only, not the prompt's
    with upstream.scalar_listeners_scope(), upstream.completion_logits_only(), mesh:
        cluster = rl_cluster_lib.RLCluster(actor=model, reference=reference, tokenizer=tokenizer,
                                           cluster_config=cluster_config)
        upstream.keep_frozen_weights_in(cluster.actor_trainer)
        if algo_config.num_iterations == 1:  # the old policy's log-probabilities are never read
            upstream.no_anchor_copy(cluster)
        upstream.host_memory_back_before_updates(cluster)
        start_step = cluster.actor_trainer.train_steps
        history = checkpoints.load_history(root, start_step, HISTORY_FILE)
        if dev:  # its curve beside the reward history; the checkpoints it keeps are the actor's
            dev.start(cluster.actor_trainer, mesh, root, params.batch_size)
        clock = checkpoints.TrainClock(root, start_step)
        feed = PromptFeed(rows, params.batch_size, params.seed, rollout)
        _learn(cluster, lambda: learner_cls(rl_cluster=cluster, algo_config=algo_config,
                                            reward_fns=rewards.tunix_reward_fns(), metric_fns=[rewards.metric_fn]),
               feed, start_step, params.max_steps, root)
        end_step = cluster.actor_trainer.train_steps
        seconds = clock.save(end_step) if end_step > start_step else clock.total()
        if dev and not feed.interrupted:
            dev.catch_up(end_step, mesh)

    history += _new_history(cluster.actor_trainer.metrics_logger, rewards, start_step, end_step, params)
    checkpoints.save_history(root, history, HISTORY_FILE)
    barrier("grpo_end")  # multi-host: no process goes on before process 0 has written the history, as after SFT
    if feed.interrupted:
        raise TrainingInterrupted(feed.stop_reason, end_step, str(root / "actor"))
    trend = reward_trend(history)
    note = None
    if trend:
        log.info("grpo: %s", trend["summary"])
        rewards_seen = ", ".join(f"{h['reward']:.2f}" for h in history if h.get("reward") is not None)
        note = f"GRPO's {trend['summary']} ({rewards_seen})."
    return {
        "enabled": True,
        "checkpoint_dir": str(root / "actor"),
        "latest_step": end_step,
        "resumed_from_step": start_step,
        "steps_this_run": end_step - start_step,
        "loss_variant": params.loss_variant,
        "beta": params.beta,
        "reference_model": reference is not None,
        "rewards": dict(rewards.weights),
        "prompts": len(rows),
        "prompts_too_long": inputs.too_long,
        "prompt_filter": screen,
        "completions_per_step": params.batch_size * params.num_generations,
        "first_reward": history[0].get("reward") if history else None,
        "last_reward": history[-1].get("reward") if history else None,
        "reward_trend": trend,
        "evaluation_note": note,
        "history": history,
        "train_seconds": seconds,  # every run's, to the latest step
        "seconds_this_run": seconds - clock.before,
        **(dev.summary(end_step) if dev else checkpoints.no_dev_eval(end_step)),
    }


def _learn(cluster, learner, feed: PromptFeed, start_step: int, max_steps: int, root) -> None:
    """`learner()` trains the cluster's actor from `start_step` to `max_steps`; at `max_steps` already, it closes."""
    if start_step >= max_steps:
        log.info("grpo: checkpoint step %d already reaches grpo.max_steps=%d; nothing to train", start_step, max_steps)
        cluster.close()
        return
    if start_step:
        log.info("resuming GRPO from checkpoint step %d in %s", start_step, root / "actor")
    cluster.actor_trainer.with_training_hooks(progress.training_hooks("grpo"))
    with stop_on_signals(feed):
        try:
            learner().train(feed)
        except StopIteration:  # stopped before its first batch, which Tunix's learner takes unguarded
            if not feed.interrupted:
                raise
            cluster.close()


def filtered_prompts(model, tokenizer, rows: pd.DataFrame, rewards: RewardSet, params: GrpoParams, mesh, root,
                     decode_weights: str = "sharded") -> tuple[pd.DataFrame, dict]:
    """(the prompts of `rows` that `model` gets right in some of its samples and not all, by `grpo.prompt_filter`'s
    reward (`screened_groups`); the screen's summary). Each prompt is sampled `samples` times with the rollouts'
    settings, a part of the pool at a time (`screen_part`); the scores are kept in `root/FILTER_FILE` after each part
    and read back by a run with the same settings, so a resumed run samples only the parts not yet screened. Fewer
    kept prompts than one batch is `NothingToLearn`."""
    spec = params.prompt_filter
    started = time.perf_counter()
    settings = {"reward": spec.reward, "samples": spec.samples, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k, "max_completion_length": params.max_completion_length}
    keys = [prompt_key(p) for p in rows["prompt"]]
    known = _kept_scores(root / FILTER_FILE, settings)
    reused = sum(k in known for k in keys)
    part = screen_part(spec)
    todo = [start for start in range(0, len(rows), part) if any(k not in known for k in keys[start:start + part])]
    screen = _Screen(model, tokenizer, rewards, params, mesh, decode_weights) if todo else None
    for done, start in enumerate(todo, 1):
        # each part's own seed: a part screened after a restart samples what it would have sampled in one go
        scores = screen(rows.iloc[start:start + part], seed=params.seed + start)
        known.update(zip(keys[start:start + part], scores.tolist()))
        checkpoints.save_history(root, {**settings, "scores": known}, FILTER_FILE)
        screened = sum(k in known for k in keys)
        left = (time.perf_counter() - started) / done * (len(todo) - done)
        log.info("grpo: prompt filter: %d of %d prompts screened (%d samples each), ~%.0f min left",
                 screened, len(rows), spec.samples, left / 60)
    kept, never, always = screened_groups(np.array([known[k] for k in keys], np.float64), spec.right_at)
    summary = {"samples": spec.samples, "reward": spec.reward, "right_at": spec.right_at, "screened": len(rows),
               "kept": int(kept.sum()), "none_right": int(never.sum()), "all_right": int(always.sum()),
               "reused": reused, "seconds": round(time.perf_counter() - started, 1)}
    rule = (f"score differently on {spec.reward!r} across" if spec.right_at is None else
            f"are right ({spec.reward!r} at {spec.right_at:g} or more) in some but not all of")
    told = (f"{summary['kept']} of {len(rows)} prompts {rule} their {spec.samples} samples "
            f"({summary['none_right']} never right, {summary['all_right']} always right)")
    if summary["kept"] < params.batch_size:
        raise NothingToLearn("grpo", f"grpo.prompt_filter: {told}, and one batch takes grpo.batch_size="
                             f"{params.batch_size}", "screen more prompts (grpo.max_prompts) or sample each more "
                             "often (grpo.prompt_filter.samples), or set grpo.prompt_filter: null")
    log.info("grpo: prompt filter: %s; training on those (%d of them read back, %.0f s)", told, reused,
             summary["seconds"])
    return rows[kept].reset_index(drop=True), summary


def screen_part(spec) -> int:
    """Prompts screened between two saves of the scores: eight of the screen's batches of samples (a kill loses at
    most those; fewer would leave more of each part's last batch idle, as its longest rows finish)."""
    return max(1, SCREEN_PART_BATCHES * spec.batch_size // spec.samples)


def screened_groups(scores: np.ndarray, right_at: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prompt (a row of `scores`, one per sample): (kept, never right, always right). A sample is right at a score
    of `right_at` or more; kept: right in some samples and not all. `right_at` None: kept whenever the scores differ
    at all (partial credit included), right meaning above 0."""
    right = scores > 0 if right_at is None else scores >= right_at - 1e-9
    never, always = ~right.any(axis=1), right.all(axis=1)
    kept = np.ptp(scores, axis=1) > 1e-9 if right_at is None else ~never & ~always
    return kept, never, always


class _Screen:
    """(prompts, samples) scores of `model`'s samples on the filter's reward, sampled as the rollouts sample; one
    sampler for every part of the pool."""

    def __init__(self, model, tokenizer, rewards: RewardSet, params: GrpoParams, mesh, decode_weights: str):
        spec = params.prompt_filter
        sampling = EvaluateParams(max_new_tokens=params.max_completion_length, batch_size=spec.batch_size,
                                  num_samples=spec.samples, stop_repeats=None, seed=params.seed,
                                  compare_base_model=False, **sampling_args(params.temperature, params.top_p,
                                                                            params.top_k))
        self.generator = Generator(model, tokenizer, sampling, params.max_prompt_length, decode_weights,
                                   stop_strings=())
        self.rewards, self.spec, self.mesh = rewards, spec, mesh

    def __call__(self, rows: pd.DataFrame, seed: int) -> np.ndarray:
        samples = self.spec.samples
        with self.mesh:
            texts, _ = self.generator(rows["prompt"].tolist(), seed=seed)
        repeated = {key: np.repeat(rows[column].astype(str).to_numpy(), samples)
                    for key, column in REWARD_COLUMNS.items() if column in rows}
        prompts = np.repeat(rows["prompt"].to_numpy(), samples)
        scores = self.rewards.score_one(self.rewards.names.index(self.spec.reward), prompts, texts, **repeated)
        return scores.reshape(len(rows), samples)


def _kept_scores(path, settings: dict) -> dict[str, list[float]]:
    """The scores an earlier screen with `settings` kept, by prompt digest: {} where there are none (no file, other
    settings, a file that cannot be read); a prompt whose scores are not `samples` numbers is screened again."""
    try:
        kept = json.loads(path.read_text())
        if {k: kept.get(k) for k in settings} != settings:
            return {}
        scores = kept["scores"].items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    n = settings["samples"]
    return {k: v for k, v in scores if isinstance(v, list) and len(v) == n
            and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)}


def training_prompts(train_formatted: pd.DataFrame, tokenizer, params: GrpoParams, mesh) -> tuple[pd.DataFrame, int]:
    """(the prompts that fit `max_prompt_length`, at most `max_prompts` of them; how many did not fit).

    A (micro-)batch that does not divide the mesh is a `GrpoError`; too few prompts to fill one batch is
    `NothingToLearn` (the node skips the stage unless `grpo.strict`).
    """
    micro = (params.micro_batch_size or params.batch_size) * params.num_generations
    if micro % data_parallel_size(mesh):
        what = "grpo.micro_batch_size" if params.micro_batch_size else "grpo.batch_size"
        raise GrpoError(
            f"{what} x grpo.num_generations = {micro} completions at a time must divide over the "
            f"{data_parallel_size(mesh)} data-parallel devices of the mesh {dict(mesh.shape)}"
        )
    screen = params.prompt_filter
    if screen is not None and screen.batch_size % data_parallel_size(mesh):
        raise GrpoError(f"grpo.prompt_filter.batch_size = {screen.batch_size} rows at a time must divide over the "
                        f"{data_parallel_size(mesh)} data-parallel devices of the mesh {dict(mesh.shape)}")
    rows, too_long = fitting_prompts(train_formatted, tokenizer, params.max_prompt_length,
                                     setting="grpo.max_prompt_length")
    if len(rows) < params.batch_size:
        raise NothingToLearn(
            "grpo",
            f"{len(rows)} of {len(train_formatted)} training prompts fit grpo.max_prompt_length="
            f"{params.max_prompt_length} tokens ({too_long} too long), and one batch takes grpo.batch_size="
            f"{params.batch_size}",
            "raise grpo.max_prompt_length" + (", or lower grpo.batch_size" if len(rows) else ""),
        )
    return prompt_pool(rows, params.max_prompts, params.seed), too_long


def _rollout_config(params: GrpoParams, tokenizer):
    """Tunix's sampling settings for the rollouts: lengths, KV cache, temperature / top-p / top-k, stop tokens."""
    return base_rollout.RolloutConfig(
        max_tokens_to_generate=params.max_completion_length,
        max_prompt_length=params.max_prompt_length,
        kv_cache_size=params.max_prompt_length + params.max_completion_length,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        eos_tokens=end_tokens(tokenizer),
    )


def _cluster_config(params: GrpoParams, mesh, root, logging_options, rollout, gather_weights: bool, dev=None):
    """Actor, reference and rollout on one mesh (the rollout's weights gathered with `gather_weights`); the actor's
    optimizer, steps and checkpoints (also at `dev`'s steps, keeping its best)."""
    roles = rl_cluster_lib.Role
    return rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine=functools.partial(upstream.grouped_rollout(), group_size=params.num_generations,
                                         gather_weights=gather_weights),
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=make_optimizer(params, params.max_steps),
            eval_every_n_steps=params.max_steps + 1,
            max_steps=params.max_steps,
            checkpoint_root_directory=str(root),
            checkpointing_options=checkpoints.options(params.checkpoint_every, params.keep_checkpoints,
                                                      params.max_steps, dev),
            metrics_logging_options=logging_options,
            data_sharding_axis=BATCH_AXES,
            pbar_description="grpo",
            # micro-batches for the log-probs and the gradient (accumulated: one update a step); generation
            # keeps no activations, so it samples the whole batch at once, the same completions as unsplit
            mini_batch_size=params.batch_size if params.micro_batch_size else None,
            train_micro_batch_size=params.micro_batch_size,
            rollout_micro_batch_size=params.batch_size if params.micro_batch_size else None,
        ),
        rollout_config=rollout,
    )


def reward_trend(history: list[dict]) -> dict | None:
    """Does the mean reward rise over the steps? Both a positive least-squares slope and a last third
    above the first third, so one lucky step at either end does not decide it. None under 3 steps."""
    rewards = np.asarray([h["reward"] for h in history if h.get("reward") is not None], dtype=np.float64)
    if len(rewards) < 3:
        return None
    third = len(rewards) // 3
    slope = float(np.polyfit(np.arange(len(rewards)), rewards, 1)[0])
    first, last = float(rewards[:third].mean()), float(rewards[-third:].mean())
    rises = slope > 0 and last > first
    summary = (
        f"mean reward {'rises' if rises else 'does not rise'} over {len(rewards)} steps: slope {slope:+.3f} a step, "
        f"first third {first:.3f}, last third {last:.3f}"
    )
    return {"slope_per_step": slope, "first_third": first, "last_third": last, "rises": rises, "summary": summary}


def _new_history(logger, rewards: RewardSet, start_step: int, end_step: int, params: GrpoParams) -> list[dict]:
    """One entry per rollout batch of this run: total reward, each reward's mean, KL, completion length, each
    judge's seconds and malformed replies.

    `step` is the actor's optimizer step after that batch (`num_iterations` updates per batch).
    """
    if end_step <= start_step:
        return []
    series = {
        "reward": checkpoints.metric_history(logger, "reward", "total/mean"),
        "reward_std": checkpoints.metric_history(logger, "reward", "total/std"),
        "completion_length": checkpoints.metric_history(logger, "completions", "mean_length"),
        **{f"reward/{n}": checkpoints.metric_history(logger, "reward", f"{n}/mean") for n in rewards.names},
        **{f"judge/{n}/{m}": checkpoints.metric_history(logger, "judge", f"{n}/{m}")
           for n in rewards.judges for m in ("seconds", "malformed")},
    }
    batches = len(series["reward"])
    kl = checkpoints.metric_history(logger, "actor", "kl") if params.beta else np.array([])
    if params.num_iterations > 1 and len(kl) == batches * params.num_iterations:
        kl = kl.reshape(batches, params.num_iterations).mean(axis=1)
    series["kl"] = kl
    history = []
    for i in range(batches):
        entry = {"step": min(start_step + (i + 1) * params.num_iterations, end_step)}
        for key, values in series.items():
            entry[key] = float(values[i]) if i < len(values) else None
        history.append(entry)
    return history
