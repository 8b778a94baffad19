import logging

import jax
import mlflow
import pandas as pd
from pydantic import TypeAdapter

from tunix_pipeline.config import (
    FormatParams,
    ModelParams,
    PlanParams,
    PreferenceParams,
    RewardParams,
    RuntimeParams,
    TrackingParams,
)
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.core.processes import is_main_process
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.data.formatting import format_records
from tunix_pipeline.data.ingest import ingest
from tunix_pipeline.models import load_run_model, load_tokenizer, parameter_counts
from tunix_pipeline.planning import peak_flops_per_device
from tunix_pipeline.stages import PREFERENCE, StageResult, policy_stage, selected_step, start_of
from tunix_pipeline.tracking.step_metrics import metrics_backends
from tunix_pipeline.train import pairs
from tunix_pipeline.train import preference as pref
from tunix_pipeline.train.checkpoints import restore_required
from tunix_pipeline.train.judge import meshes
from tunix_pipeline.train.rewards import RewardSet
from tunix_pipeline.train.skips import NothingToLearn, passed_through, skip_stage

log = logging.getLogger(__name__)


def build_pairs(
    train_formatted: pd.DataFrame,
    eval_formatted: pd.DataFrame,
    base_model: dict,
    parent_result: dict,
    model: ModelParams,
    params: PreferenceParams,
    grpo_rewards: list[dict],
    format_params: FormatParams,
    runtime: RuntimeParams,
) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(train pairs, held-out pairs, report): from `preference.data` (ingested and formatted as SFT's data is),
    or sampled from the parent's policy (SFT's) and scored with the rewards (`from_rewards`; eval pairs from the eval
    prompts): its own, else the ones GRPO optimises (`grpo_rewards`)."""
    empty = pd.DataFrame(columns=pairs.REWARD_PAIR_COLUMNS)
    if not params.enabled:
        return empty, empty, {"enabled": False}
    tokenizer = load_tokenizer(base_model["path"])
    if params.pairs == "from_data":
        train, evaluation, quality = ingest(params.data)
        return (format_records(train, tokenizer, format_params), format_records(evaluation, tokenizer, format_params),
                {"enabled": True, "pairs": "from_data", "data_quality": quality})
    spec = params.from_rewards
    specs = spec.rewards or TypeAdapter(list[RewardParams]).validate_python(grpo_rewards)
    mesh, judge_mesh = meshes(runtime, specs)
    rewards = RewardSet(specs, judge_mesh or mesh)  # a bad reward fails before the model loads
    network, _ = load_run_model(base_model["path"], model, mesh, quantize=False)
    step = restore_required(network, storage_path(parent_result["checkpoint_dir"]), policy_stage(parent_result),
                            PREFERENCE.name, selected_step(parent_result))
    train, train_counts = pairs.pairs_from_rewards(network, tokenizer, train_formatted, params, rewards, mesh,
                                                  spec.max_prompts, runtime.decode_weights)
    held_out, eval_counts = pairs.pairs_from_rewards(network, tokenizer, eval_formatted, params, rewards, mesh,
                                                    spec.eval_prompts, runtime.decode_weights)
    report = {"enabled": True, "pairs": "from_rewards", **start_of(parent_result), "start_step": step,
              "rewards": dict(rewards.weights), "margin": spec.margin,
              "train": train_counts, "eval": eval_counts}
    log.info("preference pairs from rewards: %d train pairs of %d prompts, %d held-out",
             len(train), train_counts["prompts"], len(held_out))
    return train, held_out, report


def run_preference(
    train_pairs: pd.DataFrame,
    eval_pairs: pd.DataFrame,
    pairs_report: dict,
    base_model: dict,
    parent_result: dict,
    model: ModelParams,
    params: PreferenceParams,
    runtime: RuntimeParams,
    tracking: TrackingParams,
    plan: PlanParams,
) -> StageResult:
    """DPO / ORPO / SimPO from the parent's policy (SFT's); off (`preference.enabled: false`) or with too few pairs
    to fill a batch (skipped, unless `preference.strict`): the parent's passes through.

    Either way `checkpoint_dir` is the policy the later stages (GRPO, export) start from.
    """
    if not params.enabled:
        return passed_through(parent_result)
    tokenizer = load_tokenizer(base_model["path"])
    train_tokens, train_stats = pairs.tokenize_pairs(train_pairs, tokenizer, params)
    eval_tokens, eval_stats = pairs.tokenize_pairs(eval_pairs, tokenizer, params)
    mesh = make_mesh(runtime)
    try:  # before any weights load
        batch_size = pref.check_enough_pairs(len(train_tokens), params, mesh,
                                pairs.why_too_few(pairs_report, train_stats["dropped"], params))
    except NothingToLearn as err:
        return {**skip_stage(err, params.strict, passed_through(parent_result)), "method": params.method,
                "title": params.method.upper(), "tokenize": {"train": train_stats, "eval": eval_stats}}
    network, _ = load_run_model(base_model["path"], model, mesh)
    step = restore_required(network, storage_path(parent_result["checkpoint_dir"]), policy_stage(parent_result),
                            PREFERENCE.name, selected_step(parent_result))
    backends = metrics_backends(tracking, runtime.output_root, "preference")
    result = pref.train_preference(network, train_tokens, eval_tokens, params, mesh, batch_size, backends,
                                   peak_flops_per_device(plan, runtime))
    if mlflow.active_run() is not None and is_main_process():  # held-out pair accuracy: SFT's, then the policy's
        client, run_id = mlflow.MlflowClient(), mlflow.active_run().info.run_id
        for at, key in ((0, "heldout_pair_accuracy_before"), (result["latest_step"], "heldout_pair_accuracy")):
            if result[key] is not None:
                client.log_metric(run_id, f"{pref.METRICS_PREFIX}/eval/pair_accuracy", result[key], step=at)
    return {
        **result,
        "policy_stage": PREFERENCE.name,
        **start_of(parent_result),
        "start_step": step,
        "tokenize": {"train": train_stats, "eval": eval_stats},
        **parameter_counts(network),
        "lora": model.lora is not None,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
    }
