"""The settings of every stage a run will reach, and the data it starts from, checked before its first node runs.

A misspelt reward, a judge folder that is not there or an unknown lm-eval task would otherwise stop the run
only when its stage starts: after ingest, SFT and an evaluation, hours into a TPU session. Each check here is
the one the stage itself runs (the stage's code calls the same function), done early; none loads model weights
or compiles. A stage is reached when its train node is in the run's pipeline and, for a polish stage, it is
enabled. Each failure is a `UserError` of one line that names the setting.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tunix_pipeline.config import (
    EvaluateParams,
    GrpoParams,
    JudgeParams,
    ModelParams,
    PreferenceParams,
    RewardParams,
    RuntimeParams,
    SftParams,
)
from tunix_pipeline.config.validation import ConfigError, validate_section
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.core.paths import storage_path
from tunix_pipeline.data.optional_json import NoneWhileMissing
from tunix_pipeline.evaluate import harness
from tunix_pipeline.models.hub import check_source
from tunix_pipeline.run.sessions import SessionsParams
from tunix_pipeline.run.sessions import check_previous_root as check
from tunix_pipeline.stages import GRPO, PREFERENCE, SFT, STAGES, Stage
from tunix_pipeline.train.checkpoints import check_start
from tunix_pipeline.train.rewards import RewardError, resolve

# the evaluation nodes: after SFT, and after each polish stage
EVALUATE_NODE = "evaluate_models"
PAIRS_NODE = "build_preference_pairs"  # samples pairs scored with the rewards, before the preference stage trains


def reached_stages(params: dict, node_names: Iterable[str]) -> list[Stage]:
    """The training stages this run will train: their train node is in the pipeline (a polish stage: and enabled)."""
    names = set(node_names)
    return [stage for stage in STAGES if stage.train_node in names
            and (stage.parent is None or (params.get(stage.name) or {}).get("enabled"))]


# ---------------------------------------------------------------- one check per setting
def check_rewards(specs: list[RewardParams], setting: str) -> None:
    """Every reward resolves: a built-in, an importable `package.module:function`, a judge whose source exists;
    the functions `RewardSet` calls for each (GRPO and the preference pairs build one), loading no judge model."""
    for i, spec in enumerate(specs):
        if spec.judge is not None:
            check_judge(spec.judge, f"{setting}[{i}].judge")
        else:
            try:
                resolve(spec.fn)
            except RewardError as err:
                raise RewardError(f"{setting}[{i}].fn: {err}") from None


def check_judge(judge: JudgeParams, setting: str) -> None:
    """A judge's source resolves on this machine (a folder, a .gguf file, an installed `pypi:` package)."""
    check_source(judge.source, key=f"{setting}.source")


def check_harness(evaluate: EvaluateParams) -> None:
    """lm-evaluation-harness is installed and knows every task (only when `evaluate.harness.enabled`)."""
    if evaluate.harness.enabled:
        harness.check(evaluate.harness)


def check_init_from(sft: SftParams) -> None:
    """`sft.init_from` holds a checkpoint, unless this run resumes its own (then the parent is not read)."""
    if sft.init_from:
        check_start(storage_path(sft.init_from), storage_path(sft.checkpoint_dir))


def check_previous_root(params: dict) -> None:
    """With a `sessions.plan`, `sessions.previous_root` holds the earlier sessions' ledger (the checkpoint it names
    is then `sft.init_from`)."""
    sessions = validate_section(params, "sessions", SessionsParams)
    if sessions.plan:
        check(validate_section(params, "runtime", RuntimeParams).output_root, sessions.previous_root)


def model_max_positions(model: ModelParams) -> int | None:
    """The positions the base model holds, where a local folder's config.json says (None: not known before the
    base_model node fetches or builds it)."""
    config = Path(model.source) / "config.json"
    if model.source == "tiny" or not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("max_position_embeddings") or (data.get("text_config") or {}).get("max_position_embeddings")


def check_lengths(setting: str, prompt: int, completion: int, positions: int | None) -> None:
    """A stage's prompt and completion lengths fit the model's positions together."""
    if positions is not None and prompt + completion > positions:
        raise ConfigError(f"{setting}: a prompt and its completion take up to {prompt} + {completion} = "
                          f"{prompt + completion} tokens, more than the model's {positions} positions; lower them")


# ---------------------------------------------------------------- each stage's checks
def check_sft(params: dict, positions: int | None) -> None:
    sft = validate_section(params, SFT.name, SftParams)
    check_previous_root(params)
    check_init_from(sft)


def check_preference(params: dict, positions: int | None) -> None:
    preference = validate_section(params, PREFERENCE.name, PreferenceParams)
    check_lengths("preference.max_prompt_length + max_response_length", preference.max_prompt_length,
                  preference.max_response_length, positions)
    if preference.pairs == "from_rewards":
        own = preference.from_rewards.rewards
        rewards = own or validate_section(params, GRPO.name, GrpoParams).rewards
        check_rewards(rewards, "preference.from_rewards.rewards" if own else "grpo.rewards")


def check_grpo(params: dict, positions: int | None) -> None:
    grpo = validate_section(params, GRPO.name, GrpoParams)
    check_rewards(grpo.rewards, "grpo.rewards")
    check_lengths("grpo.max_prompt_length + max_completion_length", grpo.max_prompt_length,
                  grpo.max_completion_length, positions)


STAGE_CHECKS = {SFT.name: check_sft, PREFERENCE.name: check_preference, GRPO.name: check_grpo}


# ---------------------------------------------------------------- the run
def check_reached_stages(params: dict, node_names: Iterable[str]) -> None:
    """Every check of the stages this run reaches (see the module's docstring); the first failure as one line."""
    names = set(node_names)
    stages = reached_stages(params, names)
    if PAIRS_NODE in names and PREFERENCE not in stages and (params.get(PREFERENCE.name) or {}).get("enabled"):
        stages.append(PREFERENCE)  # its pairs are sampled and scored in this run, its training later
    positions = model_max_positions(validate_section(params, "model", ModelParams)) if "model" in params else None
    for stage in stages:
        STAGE_CHECKS[stage.name](params, positions)
    if names & {EVALUATE_NODE, *(f"evaluate_after_{stage.name}" for stage in stages)} and "evaluate" in params:
        evaluate = validate_section(params, "evaluate", EvaluateParams)
        if evaluate.judge is not None:
            check_judge(evaluate.judge, "evaluate.judge")
        check_harness(evaluate)


# ---------------------------------------------------------------- the data the run starts from
class MissingInputError(UserError, FileNotFoundError):
    """A run that starts part-way through the DAG reads an output no earlier run wrote."""


def check_inputs_written(pipeline, catalog, pipelines: dict) -> None:
    """Every dataset the run reads but does not write (`kedro run --pipelines=sft` reads the tokenized rows) is
    on disk: else one line names it and the pipeline that writes it, before any node runs. A dataset that loads
    as None while missing (`optional_json.NoneWhileMissing`) is never missing."""
    missing = [name for name in sorted(pipeline.inputs()) if not name.startswith("params:") and name != "parameters"
               and name in catalog and not isinstance(catalog.get(name), NoneWhileMissing) and not catalog.exists(name)]
    if not missing:
        return
    # each one's smallest registered pipeline that writes it: the stage's own package
    outputs = {key: p.outputs() for key, p in pipelines.items()}
    writers = sorted({min((len(pipelines[key].nodes), key) for key, written in outputs.items() if name in written)[1]
                      for name in missing if any(name in written for written in outputs.values())})
    where = getattr(catalog.get(missing[0]), "_filepath", None)  # file datasets keep their path only there
    more = ", ..." if len(missing) > 1 else ""
    first = f"`kedro run --pipelines={','.join(writers)}` first, or " if writers else ""
    raise MissingInputError(
        f"this run reads {', '.join(missing)}, which no earlier run wrote{f' ({where}{more})' if where else ''}: "
        f"run {first}the whole DAG (`kedro run`), with the same --env")
