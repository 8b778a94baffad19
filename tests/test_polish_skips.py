"""An optional polish stage with nothing to learn from is skipped with its reason, and the run goes on to the export."""

import json

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project
from omegaconf import OmegaConf

from tunix_pipeline.train.skips import NothingToLearn, passed_through, skip_stage

SFT = {"checkpoint_dir": "data/06_models/sft_checkpoints", "latest_step": 30}


def test_a_skipped_stage_passes_its_parent_on_and_tags_the_run(tmp_path):
    err = NothingToLearn("preference", "0 training pairs cannot fill one batch of 4 pairs", "lower the margin")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:  # an experiment of this store (another test's may be the active one)
        with mlflow.start_run(experiment_id=mlflow.MlflowClient().create_experiment("skips")) as run:
            result = skip_stage(err, strict=False, parent_policy=passed_through(SFT))
        tags = mlflow.MlflowClient().get_run(run.info.run_id).data.tags
    finally:
        mlflow.set_tracking_uri(None)  # also unsets MLFLOW_TRACKING_URI, which later runs would inherit
    assert result == {"enabled": False, "skipped": True, "skip_reason": err.reason, "skip_fix": "lower the margin",
                      "checkpoint_dir": SFT["checkpoint_dir"], "latest_step": 30,
                      "policy_stage": "sft", "start_stage": "sft", "start_checkpoint_dir": SFT["checkpoint_dir"],
                      "start_step": 30}
    assert tags["preference.skipped"] == "true"
    assert tags["preference.skip_reason"] == "0 training pairs cannot fill one batch of 4 pairs: lower the margin"
    with pytest.raises(NothingToLearn, match="preference: 0 training pairs"):
        skip_stage(err, strict=True, parent_policy=passed_through(SFT))


def _run(project, **params):
    """The default DAG with `params` ({"a.b": value}, as `kedro run --params a.b=value`)."""
    bootstrap_project(project)
    nested = OmegaConf.to_container(OmegaConf.from_dotlist([f"{k}={v}" for k, v in params.items()]))
    with KedroSession.create(project_path=project, runtime_params=nested) as session:
        session.run()  # the default DAG
    models, reporting = project / "data" / "06_models", project / "data" / "08_reporting"
    outputs = {name: json.loads((models / f"{name}.json").read_text())
               for name in ("sft_result", "preference_result", "grpo_result", "exported_model")}
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("tunix_pipeline").experiment_id])[0]
    return outputs, run, reporting


@pytest.mark.slow
def test_no_pair_passes_the_margin_so_preference_is_skipped_and_grpo_and_export_go_on(project):
    # the rewards of the smoke run's samples differ by at most 3.5 (format 1 + 0.5, answer 2): none by 100; every
    # model is also scored shown 2 solved training rows, and each tuned policy paired against the base both ways
    outputs, run, reporting = _run(project, **{"sft.max_steps": 30, "preference.from_rewards.margin": 100.0,
                                               "evaluate.few_shot": 2, "evaluate.few_shot_models": "all"})
    sft, preference, grpo, exported = (outputs[k] for k in ("sft_result", "preference_result", "grpo_result",
                                                            "exported_model"))
    assert run.info.status == "FINISHED" and run.data.tags["preference.skipped"] == "true"
    assert "differ by less than preference.from_rewards.margin=100.0" in run.data.tags["preference.skip_reason"]
    assert "lower preference.from_rewards.margin" in run.data.tags["preference.skip_reason"]
    assert preference["skipped"] and not preference["enabled"] and preference["checkpoint_dir"] == sft["checkpoint_dir"]
    report = json.loads((reporting / "preference_pairs.json").read_text())
    assert report["train"]["pairs"] == 0 and report["train"]["below_margin"] == report["train"]["prompts"] == 64
    assert (reporting / "preference_eval_report.md").read_text().count("was skipped: 0 training pairs") == 1
    # GRPO trained from the SFT checkpoint, and its policy is what was exported
    assert grpo["enabled"] and grpo["start_checkpoint_dir"] == sft["checkpoint_dir"] and grpo["start_step"] == 30
    assert exported["stage"] == "grpo" and exported["skipped_stages"] == {"preference": preference["skip_reason"]}
    assert (project / "data" / "06_models" / "exported" / "config.json").is_file()
    _assert_the_base_is_scored_zero_shot_and_2_shot(project, run, reporting)


def _assert_the_base_is_scored_zero_shot_and_2_shot(project, run, reporting):
    """`evaluate.few_shot: 2` for every model: base zero-shot and 2-shot side by side on the same problems, SFT's and
    GRPO's policies paired against both, and each k-shot score against its parent's (reports, metrics, MLflow)."""
    import pandas as pd

    metrics = json.loads((reporting / "eval_metrics.json").read_text())
    assert list(metrics) == ["base", "base_2shot", "tuned", "tuned_2shot"]
    assert metrics["base_2shot"]["prompts"] == metrics["base"]["prompts"] > 0
    assert metrics["base_2shot"]["eval_loss"] is None  # the loss is the base's: not measured twice
    tuned = metrics["tuned"]
    assert tuned["paired"]["against"] == "base" and tuned["paired_few_shot"]["against"] == "base_2shot"
    assert metrics["tuned_2shot"]["paired"]["against"] == "base_2shot"
    samples = pd.read_json(project / "data" / "07_model_output" / "eval_samples.jsonl", lines=True, dtype=False)
    base, shown = samples[samples["model"] == "base"], samples[samples["model"] == "base_2shot"]
    assert shown["id"].tolist() == base["id"].tolist()
    assert all(p.endswith(q.split("<start_of_turn>user\n")[-1]) and p.count("<start_of_turn>model\n<reasoning>") == 2
               for p, q in zip(shown["prompt"], base["prompt"]))
    after_grpo = json.loads((reporting / "grpo_eval_metrics.json").read_text())
    assert list(after_grpo) == ["sft", "sft_2shot", "grpo", "grpo_2shot"]
    grpo = after_grpo["grpo"]
    assert (grpo["paired"]["against"], grpo["paired_base"]["against"], grpo["paired_few_shot"]["against"]) == \
        ("sft", "base", "base_2shot")
    assert after_grpo["grpo_2shot"]["paired"]["against"] == "sft_2shot"
    assert "| tuned vs base_2shot |" in (reporting / "eval_report.md").read_text()
    assert "| grpo vs base_2shot |" in (reporting / "grpo_eval_report.md").read_text()
    assert {"eval_metrics.base_2shot.lenient_accuracy", "eval_metrics.tuned.paired_few_shot.lenient_accuracy.p_value",
            "grpo_eval_metrics.grpo.paired_few_shot.lenient_accuracy.p_value"} <= set(run.data.metrics)


@pytest.mark.slow
def test_the_default_dag_with_lora_and_packing_runs_to_the_export(project):
    outputs, run, _ = _run(project, **{"model.lora.rank": 8, "model.lora.alpha": 16, "tokenize.pack": True})
    sft, preference, exported = outputs["sft_result"], outputs["preference_result"], outputs["exported_model"]
    assert run.info.status == "FINISHED" and sft["latest_step"] == 200 and sft["lora"]
    assert exported["merged_lora"] and (project / "data" / "06_models" / "exported" / "config.json").is_file()
    # the preference stage trained (the export is GRPO's, from the DPO policy) or was skipped with its reason
    # recorded (the export is GRPO's from SFT's): never a failed run
    if preference.get("skipped"):
        assert run.data.tags["preference.skip_reason"].startswith(preference["skip_reason"])
        assert exported["skipped_stages"] == {"preference": preference["skip_reason"]}
        assert outputs["grpo_result"]["start_checkpoint_dir"] == sft["checkpoint_dir"]
    else:
        assert preference["enabled"] and "preference.skipped" not in run.data.tags
        assert outputs["grpo_result"]["start_checkpoint_dir"] == preference["checkpoint_dir"]
    assert exported["stage"] == "grpo"
