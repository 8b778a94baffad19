"""Every stage's settings checked before the first node: each check with a bad setting (one line naming it) and a
good one, which stages a run reaches, and a `kedro run` that stops on a misspelt GRPO reward before ingest."""

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kedro.config import OmegaConfigLoader

from tunix_pipeline.config import EvaluateParams, HarnessParams, JudgeParams, ModelParams, RewardParams, SftParams
from tunix_pipeline.config.validation import ConfigError
from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.core.errors import HarnessError, UserError
from tunix_pipeline.run.preflight import (
    check_harness, check_init_from, check_lengths, check_previous_root, check_reached_stages, check_rewards,
    model_max_positions, reached_stages,
)
from tunix_pipeline.stages import GRPO, PREFERENCE, SFT
from tunix_pipeline.train.checkpoints import CheckpointError
from tunix_pipeline.train.rewards import RewardError

KEDRO = str(Path(sys.executable).parent / "kedro")
CONF = Path(__file__).resolve().parents[1] / "conf"
# every section as the smoke run has it (conf/base under conf/gpu_smoke); each test changes what it checks
BASE = OmegaConfigLoader(conf_source=str(CONF), base_env="base", default_run_env="gpu_smoke",
                         merge_strategy={"parameters": "soft"})["parameters"]
ALL_TRAIN_NODES = {SFT.train_node, PREFERENCE.train_node, GRPO.train_node}


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# ---------------------------------------------------------------- rewards
def test_reward_names_and_dotted_paths():
    check_rewards([RewardParams(fn="format_exact"), RewardParams(fn="tunix_pipeline.train.rewards:answer")], "grpo.rewards")
    with pytest.raises(RewardError) as err:
        check_rewards([RewardParams(fn="answer"), RewardParams(fn="format")], "grpo.rewards")
    assert one_line(err).startswith("grpo.rewards[1].fn: reward 'format' is neither a built-in")
    assert "did you mean format_exact?" in str(err.value)
    with pytest.raises(RewardError, match=r"^grpo.rewards\[0\].fn: reward 'no_such_pkg.mod:f': cannot import module"):
        check_rewards([RewardParams(fn="no_such_pkg.mod:f")], "grpo.rewards")
    with pytest.raises(RewardError, match=r"tunix_pipeline.train.rewards has no function 'nope'"):
        check_rewards([RewardParams(fn="tunix_pipeline.train.rewards:nope")], "grpo.rewards")


def test_judge_sources(tmp_path):
    folder = tmp_path / "judge"
    folder.mkdir()
    check_rewards([RewardParams(fn="judge", judge=JudgeParams(source=str(folder)))], "grpo.rewards")
    check_rewards([RewardParams(fn="judge", judge=JudgeParams(source="google/gemma-3-1b-it"))], "grpo.rewards")  # hub
    for source, what in ((str(tmp_path / "missing"), "model folder not found"),
                         (str(tmp_path / "judge.gguf"), "GGUF file not found"),
                         ("pypi:no-such-judge-package", "the package is not installed")):
        with pytest.raises(ModelError) as err:
            check_rewards([RewardParams(fn="answer"), RewardParams(fn="judge", judge=JudgeParams(source=source))],
                          "preference.from_rewards.rewards")
        assert one_line(err).startswith("preference.from_rewards.rewards[1].judge.source") and what in str(err.value)


# ---------------------------------------------------------------- lm-evaluation-harness
@pytest.mark.slow
def test_harness_tasks_are_looked_up_only_when_the_harness_is_on(tmp_path):
    check_harness(EvaluateParams(harness=HarnessParams(enabled=False, tasks=["gsm8kk"])))  # off: nothing looked up
    with pytest.raises(HarnessError) as err:
        check_harness(EvaluateParams(harness=HarnessParams(enabled=True, tasks=["tagged_answer", "gsm8kk"])))
    assert one_line(err) == ("evaluate.harness.tasks: 'gsm8kk' is not one of lm-eval's tasks, groups or tags; "
                             "did you mean gsm8k?")
    check_harness(EvaluateParams(harness=HarnessParams(enabled=True, tasks=["tagged_answer", "gsm8k"])))
    with pytest.raises(HarnessError, match="no task file"):
        check_harness(EvaluateParams(harness=HarnessParams(enabled=True, tasks=[str(tmp_path / "mine.yaml")])))


# ---------------------------------------------------------------- where SFT starts
def sft(**kwargs) -> SftParams:
    return SftParams.model_validate({**BASE["sft"], **kwargs})


def test_init_from_holds_a_checkpoint_unless_the_run_resumes_its_own(tmp_path):
    parent, own = tmp_path / "parent", tmp_path / "own"
    check_init_from(sft(checkpoint_dir=str(own)))  # no init_from: nothing to check
    with pytest.raises(CheckpointError) as err:
        check_init_from(sft(init_from=str(parent), checkpoint_dir=str(own)))
    assert one_line(err).startswith(f"sft.init_from: no checkpoint in {parent}")
    parent.mkdir()
    with pytest.raises(CheckpointError):  # a folder without a step folder
        check_init_from(sft(init_from=str(parent), checkpoint_dir=str(own)))
    (parent / "7").mkdir()
    check_init_from(sft(init_from=str(parent), checkpoint_dir=str(own)))
    (own / "3").mkdir(parents=True)  # an interrupted run resumes its own checkpoints: the parent is not read
    check_init_from(sft(init_from=str(tmp_path / "gone"), checkpoint_dir=str(own)))


def test_previous_root_holds_the_ledger(tmp_path):
    params = {"runtime": {"output_root": str(tmp_path / "out")},
              "sessions": {"plan": [{"name": "s1", "hours": 1}], "previous_root": str(tmp_path / "attached")}}
    with pytest.raises(UserError) as err:
        check_previous_root(params)
    assert one_line(err).startswith(f"sessions.previous_root: no sessions.json in {tmp_path / 'attached'}")
    (tmp_path / "attached").mkdir()
    (tmp_path / "attached" / "sessions.json").write_text(json.dumps({"runs": [], "finished": {}}))
    check_previous_root(params)
    check_previous_root({**params, "sessions": {"previous_root": str(tmp_path / "nowhere")}})  # no plan: not read


# ---------------------------------------------------------------- lengths
def test_polish_lengths_fit_the_models_positions(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma", "max_position_embeddings": 512}))
    positions = model_max_positions(ModelParams(source=str(tmp_path)))
    assert positions == 512
    assert model_max_positions(ModelParams(source="tiny")) is None  # built later: not known yet
    check_lengths("grpo.max_prompt_length + max_completion_length", 256, 256, positions)
    with pytest.raises(ConfigError) as err:
        check_lengths("grpo.max_prompt_length + max_completion_length", 256, 300, positions)
    assert one_line(err).startswith("grpo.max_prompt_length + max_completion_length: a prompt and its completion take "
                                    "up to 256 + 300 = 556 tokens, more than the model's 512 positions")
    check_lengths("grpo.max_prompt_length + max_completion_length", 256, 300, None)


# ---------------------------------------------------------------- the stages a run reaches
def params_with(grpo: dict, preference: dict | None = None) -> dict:
    params = copy.deepcopy(BASE)
    params["grpo"].update(grpo)
    params["preference"].update({"enabled": False, **(preference or {})})
    return params


def test_only_reached_stages_are_checked():
    bad = {"rewards": [{"fn": "format"}]}
    assert reached_stages(params_with({"enabled": True}), ALL_TRAIN_NODES) == [SFT, GRPO]
    assert reached_stages(params_with({"enabled": True}), {SFT.train_node}) == [SFT]
    check_reached_stages(params_with({"enabled": False, **bad}), ALL_TRAIN_NODES)  # off: not reached
    check_reached_stages(params_with({"enabled": True, **bad}), {SFT.train_node, "evaluate_models"})  # not in the run
    with pytest.raises(RewardError, match=r"^grpo.rewards\[0\].fn: reward 'format'"):
        check_reached_stages(params_with({"enabled": True, **bad}), ALL_TRAIN_NODES)
    # the preference stage samples its pairs with GRPO's rewards (its own, where it names them)
    with pytest.raises(RewardError, match=r"^grpo.rewards\[0\].fn"):
        check_reached_stages(params_with({"enabled": False, **bad}, {"enabled": True}), ALL_TRAIN_NODES)
    params = params_with({"enabled": False}, {"enabled": True})
    params["preference"]["from_rewards"]["rewards"] = [{"fn": "answr"}]
    with pytest.raises(RewardError, match=r"^preference.from_rewards.rewards\[0\].fn: reward 'answr'"):
        check_reached_stages(params, ALL_TRAIN_NODES)


# ---------------------------------------------------------------- the run
@pytest.mark.slow
def test_kedro_run_stops_on_a_misspelt_reward_before_ingest(project):
    (project / "conf" / "local" / "parameters.yml").write_text("grpo:\n  rewards:\n    - {fn: format}\n")
    started = time.monotonic()
    result = subprocess.run([KEDRO, "run", "--pipelines=smoke", "--params", "grpo.enabled=true"], cwd=project,
                            capture_output=True, text=True, env=os.environ, timeout=600)
    seconds = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: grpo.rewards[0].fn: reward 'format' is neither a built-in (format_exact, format_approx, "
                      "answer, length_penalty, judge) nor a dotted path `package.module:function`; did you mean "
                      "format_exact?"], output[-3000:]
    assert "Traceback" not in output
    assert "Running node" not in output and not (project / "data" / "02_intermediate").exists()  # ingest never ran
    assert seconds < 120, seconds  # Kedro's and JAX's start-up on a shared 2-core CPU, not a stage


@pytest.mark.slow
def test_a_run_that_starts_part_way_needs_what_earlier_stages_wrote(project):
    result = subprocess.run([KEDRO, "run", "--pipelines=sft"], cwd=project, capture_output=True, text=True,
                            env=os.environ, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    # the tokenize report is optional (the preflight reads it when it is there): not named
    assert errors[0].startswith("Error: this run reads base_model, eval_few_shot, eval_formatted, eval_tokens, train_tokens, which no "
                                "earlier run wrote (")
    assert "run `kedro run --pipelines=base_model,format,tokenize` first, or the whole DAG" in errors[0]
    assert "Running node" not in output
