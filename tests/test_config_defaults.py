"""Every default in one place: the code's (`tunix_pipeline.config`). conf/base repeats it, so a user reads the
defaults where they configure, and may not differ from it: what an environment inherits is the code's default, for
a real model. The tiny model's sizes are the smoke run's own environment (conf/gpu_smoke)."""

import types
import typing
from pathlib import Path

from kedro.config import OmegaConfigLoader
from kedro.framework.project import configure_project
from pydantic import BaseModel, TypeAdapter

from tunix_pipeline.config.validation import section_models
from tunix_pipeline.pipeline_registry import register_pipelines

CONF = Path(__file__).parents[1] / "conf"


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


def test_conf_base_is_the_code_defaults():
    params = OmegaConfigLoader(conf_source=str(CONF), base_env="base", default_run_env="base")["parameters"]
    configure_project("tunix_pipeline")  # as Kedro at start-up: the registry finds the pipelines of this package
    models = section_models(register_pipelines())
    assert {"runtime", "sft", "grpo", "preference", "evaluate", "tracking", "plan"} <= set(models)
    found = {setting: (conf, default) for section, model in models.items() if section in params
             for setting, conf, default in differences(model, params[section], f"{section}.")}
    assert not found, "conf/base and tunix_pipeline.config disagree (setting: (conf/base, code default)): " \
        f"{found}; make the code's default conf/base's value (a smoke-run size belongs in conf/gpu_smoke)"


def test_a_drifted_default_is_found():
    from tunix_pipeline.config import RuntimeParams

    found = list(differences(RuntimeParams, {"host_device_count": 3, "shared_folder_timeout_s": 20}, "runtime."))
    assert found == [("runtime.host_device_count", 3, RuntimeParams().host_device_count)]
