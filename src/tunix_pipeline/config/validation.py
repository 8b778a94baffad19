"""Parameter errors as one line a user can act on: which setting, what is wrong, the closest valid key.

Kedro validates each `params:` section against its node's pydantic hint and reports pydantic's
multi-line text; the hooks validate theirs directly. Both come here to be said in one line.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing

from pydantic import BaseModel, ValidationError

from tunix_pipeline.core.errors import UserError

M = typing.TypeVar("M", bound=BaseModel)


class ConfigError(UserError, ValueError):
    """A parameter that is unknown, missing or out of range."""


def closest(name: str, choices) -> str:
    """'; did you mean X?' for the closest of `choices` to a misspelt `name`, or ''."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else ""


def submodel(annotation) -> type[BaseModel] | None:
    """The model of a nested section (`X`, `X | None`, `list[X]`, `dict[str, X]`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, dict, typing.Union, types.UnionType):
        return next((m for m in map(submodel, typing.get_args(annotation)) if m is not None), None)
    return None


TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _where(model: type[BaseModel], section: str, loc: tuple) -> tuple[str, type[BaseModel] | None]:
    """(dotted setting, the model that holds its last key): pydantic's union-member tags dropped."""
    path, current, holder = section, model, model
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif current is not None and part in current.model_fields:
            holder, current = current, submodel(current.model_fields[part].annotation)
            path += f".{part}"
        elif part.isidentifier() and part not in TYPE_TAGS and not part[0].isupper() and (
                i == len(loc) - 1 or current is None):
            holder, current = current, None  # an unknown key, or a key of a free-form mapping
            path += f".{part}"
        # else a union member's tag: "literal['auto']", "dict[...]", "RewardParams"
    return path, holder


def one_line(section: str, model: type[BaseModel], err: ValidationError) -> str:
    """Each problem of `err` as `setting: what` (an unknown key with the closest valid one), joined by '; '.

    Of a union's alternatives only the deepest errors are kept: `mesh: {fsd: 2}` is a bad mesh key,
    not also "should be 'auto'".
    """
    problems: dict[str, list[str]] = {}
    given: dict[str, str] = {}
    for error in err.errors():
        setting, holder = _where(model, section, tuple(error["loc"]))
        kind = error["type"]
        if kind == "extra_forbidden":
            parent, key = setting.rsplit(".", 1)
            text = "unknown setting" + closest(key, holder.model_fields if holder is not None else {}).replace(
                "mean ", f"mean {parent}.")
        elif kind == "missing":
            text = f"required: set it in your environment's parameters.yml or with --params {setting}=..."
        else:
            text = error["msg"].removeprefix("Value error, ")
            if kind != "value_error" and not isinstance(error.get("input"), (dict, list)):
                given[setting] = f" (got {error['input']!r})"
        problems.setdefault(setting, []).append(text)
    deepest = [s for s in problems if not any(o != s and o.startswith((s + ".", s + "[")) for o in problems)]
    return "; ".join(f"{s}: {' or '.join(dict.fromkeys(problems[s]))}{given.get(s, '')}" for s in deepest)


def validate_section(params: dict, section: str, model: type[M]) -> M:
    """`params[section]` as `model`; a `ConfigError` of one line when it does not validate."""
    try:
        return model.model_validate(params.get(section) or {})
    except ValidationError as err:
        raise ConfigError(f"parameters: {one_line(section, model, err)}") from None


def section_models(pipelines) -> dict[str, type[BaseModel]]:
    """{parameters section: its pydantic model}, from the nodes' type hints (what Kedro validates them with)."""
    models = {}
    for pipeline in pipelines.values():
        for node in pipeline.nodes:
            hints = typing.get_type_hints(node.func)
            for name, dataset in zip(inspect.signature(node.func).parameters, node.inputs):
                hint = hints.get(name)
                if dataset.startswith("params:") and isinstance(hint, type) and issubclass(hint, BaseModel):
                    models[dataset.removeprefix("params:")] = hint
    return models


def check_parameters(params: dict, pipelines) -> None:
    """Every section the pipelines' nodes take, validated as Kedro validates it; the first bad one as one line."""
    for section, model in sorted(section_models(pipelines).items()):
        if section in params:
            validate_section(params, section, model)
