import pandas as pd

from tunix_pipeline.config import GrpoParams, ModelParams, RuntimeParams, TrackingParams
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.evaluate.dev_eval import DevEval, log_curve
from tunix_pipeline.models import load_run_model, load_tokenizer, parameter_counts
from tunix_pipeline.stages import GRPO, StageResult, policy_stage, selected_step, start_of
from tunix_pipeline.tracking.step_metrics import MlflowBackend, metrics_backends
from tunix_pipeline.train.checkpoints import restore_required
from tunix_pipeline.train.grpo import prepare, train_grpo
from tunix_pipeline.train.judge import meshes
from tunix_pipeline.train.skips import NothingToLearn, passed_through, skip_stage


def run_grpo(
    train_formatted: pd.DataFrame,
    eval_formatted: pd.DataFrame,
    base_model: dict,
    parent_result: dict,
    model: ModelParams,
    grpo: GrpoParams,
    runtime: RuntimeParams,
    tracking: TrackingParams,
) -> StageResult:
    """GRPO from its parent's policy (the preference stage's, or SFT's passed through it); off, or with no prompt
    that fits (skipped, unless `grpo.strict`): that policy passes through. Either way `checkpoint_dir` is the policy
    the later stages use, and `start_*` record where it started."""
    if not grpo.enabled:
        return passed_through(parent_result)
    mesh, judge_mesh = meshes(runtime, grpo.rewards)  # with a judge on its own devices, the policy has the rest
    tokenizer = load_tokenizer(base_model["path"])
    try:  # rewards that resolve and prompts that fit, before any weights load
        inputs = prepare(train_formatted, tokenizer, grpo, mesh, judge_mesh)
    except NothingToLearn as err:
        return skip_stage(err, grpo.strict, passed_through(parent_result))
    # the dev split's score and the best step (`grpo.dev_eval`), its rows checked before any weights load
    dev = DevEval(grpo.dev_eval, tokenizer, eval_formatted, GRPO.name, runtime.decode_weights) if grpo.dev_eval else None
    network, _ = load_run_model(base_model["path"], model, mesh)
    step = restore_required(network, storage_path(parent_result["checkpoint_dir"]), policy_stage(parent_result),
                            GRPO.name, selected_step(parent_result))
    backends = metrics_backends(tracking, runtime.output_root, "grpo")
    try:
        result = train_grpo(network, tokenizer, inputs, grpo, mesh, backends, runtime.decode_weights, dev)
    except NothingToLearn as err:  # `grpo.prompt_filter` kept too few prompts
        return skip_stage(err, grpo.strict, passed_through(parent_result))
    if backends and MlflowBackend in backends:  # the points measured after its backends closed
        log_curve(result["dev_curve"], "grpo")
    return {
        **result,
        "policy_stage": GRPO.name,
        **start_of(parent_result),
        "start_step": step,
        **parameter_counts(network),
        "lora": model.lora is not None,
        "mesh": dict(mesh.shape),
    }
