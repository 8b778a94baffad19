"""Every default in one place: the code's (`tunix_pipeline.config`). Where conf/base sets a field to another value
(sized for the smoke run on the tiny model: a recipe for a real model overrides it), its line says so with
`default: <the code's value>`, and that value must be the code's, so the two homes cannot drift apart silently."""

import inspect
import re
import types
import typing
from pathlib import Path

import yaml
from kedro.config import OmegaConfigLoader
from pydantic import BaseModel, TypeAdapter

from tunix_pipeline.pipeline_registry import register_pipelines

CONF = Path(__file__).parents[1] / "conf"
MARK = re.compile(r"default: ([^\s;)]+)")


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


def marked_defaults(folder: Path = CONF / "base") -> dict[str, object]:
    """{setting: the value its `default: X` comment names} for every marked line of the folder's YAML files."""
    marked = {}
    for path in sorted(folder.glob("parameters*.yml")):
        stack: list[tuple[int, str]] = []
        for line in path.read_text().splitlines():
            key = re.match(r"^(\s*)([A-Za-z_]\w*):", line)
            if not key:
                continue
            indent = len(key.group(1))
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, key.group(2))]
            comment = line.split("#", 1)[1] if "#" in line else ""
            if found := MARK.search(comment):
                marked[".".join(k for _, k in stack)] = yaml.safe_load(found.group(1))
    return marked


def test_conf_base_differs_from_the_code_only_where_it_says_so():
    params = OmegaConfigLoader(conf_source=str(CONF), base_env="base", default_run_env="base")["parameters"]
    models = section_models()
    assert {"runtime", "sft", "grpo", "preference", "evaluate", "tracking", "plan"} <= set(models)
    found = {setting: (conf, default) for section, model in models.items() if section in params
             for setting, conf, default in differences(model, params[section], f"{section}.")}
    marked = marked_defaults()
    unmarked = {k: v for k, v in found.items() if k not in marked}
    assert not unmarked, "conf/base and tunix_pipeline.config disagree (setting: (conf/base, code default)): " \
        f"{unmarked}; make the code's default conf/base's value, or mark the line `# default: <code's value>`"
    assert not set(marked) - set(found), f"marked `default:` but equal to the code: {sorted(set(marked) - set(found))}"
    for setting, value in marked.items():
        default = found[setting][1]
        adapter = TypeAdapter(type(default)) if default is not None else None
        said = adapter.dump_python(adapter.validate_python(value)) if adapter else value
        assert said == default, f"conf/base says {setting} defaults to {value!r}; the code's default is {default!r}"


def test_a_drifted_default_is_found():
    from tunix_pipeline.config import RuntimeParams

    found = list(differences(RuntimeParams, {"host_device_count": 3, "shared_folder_timeout_s": 20}, "runtime."))
    assert found == [("runtime.host_device_count", 3, RuntimeParams().host_device_count)]
