"""Every default in one place: where conf/base sets a field, the pydantic default (used by code that builds a
section directly: tests, benchmarks, the planner) is the same value, so the two homes cannot drift apart."""

import inspect
import types
import typing
from pathlib import Path

from kedro.config import OmegaConfigLoader
from pydantic import BaseModel, TypeAdapter

from tunix_pipeline.pipeline_registry import register_pipelines

CONF = Path(__file__).parents[1] / "conf"

# Known differences, each to be resolved by choosing one value (then delete the line; a stale line fails too).
# sft.warmup_steps: conf/base's 5 suits its short demo run; the tests and benchmarks that build SftParams rely on 0.
# runtime.mesh: conf/base puts tp on the fake 8-device CPU mesh; code that builds RuntimeParams() (the planner's
# tests, benchmarks) expects "auto", which also fits any device count.
# grpo / preference: their sections belong to work in progress on GRPO (issue 14) and preference tuning (issue 19).
KNOWN = {
    "sft.warmup_steps", "runtime.mesh",
    "grpo.max_prompt_length", "grpo.max_completion_length", "grpo.learning_rate", "grpo.checkpoint_every",
    "grpo.keep_checkpoints",
    "preference.enabled", "preference.from_rewards.eval_prompts", "preference.from_rewards.max_new_tokens",
    "preference.from_rewards.batch_size", "preference.max_prompt_length", "preference.max_response_length",
    "preference.per_device_batch_size", "preference.max_steps", "preference.learning_rate",
}


def section_models() -> dict[str, type[BaseModel]]:
    """{parameters section: its pydantic model}, from the nodes' type hints (what Kedro validates them with)."""
    models = {}
    for pipeline in register_pipelines().values():
        for node in pipeline.nodes:
            hints = typing.get_type_hints(node.func)
            for name, dataset in zip(inspect.signature(node.func).parameters, node.inputs):
                hint = hints.get(name)
                if dataset.startswith("params:") and isinstance(hint, type) and issubclass(hint, BaseModel):
                    models[dataset.removeprefix("params:")] = hint
    return models


def _submodel(annotation) -> type[BaseModel] | None:
    """The model of a nested section (`X` or `X | None`), not of a collection of them."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for candidate in (annotation, *(typing.get_args(annotation) if union else ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def differences(model: type[BaseModel], values: dict, where: str = ""):
    """(setting, conf/base value, pydantic default) for each field conf/base sets to another value than the default."""
    for key, value in values.items():
        field = model.model_fields[key]
        nested = _submodel(field.annotation)
        if nested is not None and isinstance(value, dict):
            yield from differences(nested, value, f"{where}{key}.")
        elif not field.is_required():
            adapter = TypeAdapter(field.annotation)  # compared as validated: 1 == 1.0, a dict == its model
            conf, default = (adapter.dump_python(adapter.validate_python(v)) for v in
                             (value, field.get_default(call_default_factory=True)))
            if conf != default:
                yield f"{where}{key}", conf, default


def test_conf_base_values_equal_the_pydantic_defaults():
    params = OmegaConfigLoader(conf_source=str(CONF), base_env="base", default_run_env="base")["parameters"]
    models = section_models()
    assert {"runtime", "sft", "grpo", "preference", "evaluate", "tracking", "plan"} <= set(models)
    found = {setting: (conf, default) for section, model in models.items() if section in params
             for setting, conf, default in differences(model, params[section], f"{section}.")}
    drifted = {k: v for k, v in found.items() if k not in KNOWN}
    assert not drifted, "conf/base and tunix_pipeline.config disagree (setting: (conf/base, pydantic default)): " \
        f"{drifted}; make the default in tunix_pipeline.config equal conf/base's value"
    assert not KNOWN - set(found), f"no longer different, delete from KNOWN: {sorted(KNOWN - set(found))}"


def test_a_drifted_default_is_found():
    from tunix_pipeline.config import RuntimeParams

    found = list(differences(RuntimeParams, {"host_device_count": 3, "shared_folder_timeout_s": 20}, "runtime."))
    assert found == [("runtime.host_device_count", 3, RuntimeParams().host_device_count)]
