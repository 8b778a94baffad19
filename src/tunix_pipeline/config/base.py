"""The base of every settings section, and the type of its output locations."""

from typing import Annotated

from omegaconf import OmegaConf
from pydantic import AfterValidator, BaseModel, ConfigDict

from tunix_pipeline.core.paths import location_problem


def _reachable(value: str) -> str:
    if (problem := location_problem(value)) is not None:
        raise ValueError(problem)
    return value


# an output location: a local folder or an object-store URI (`gs://bucket/run`), checked once when its section
# validates (a URI epath cannot reach, or whose package is missing, names the setting before any stage runs)
Location = Annotated[str, AfterValidator(_reachable)]


class Strict(BaseModel):
    """Unknown keys are errors (a typo such as `max_step` stops the run before it starts); a section is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def changed(self, *changes: dict | None):
        """This section with `changes` (a session's, as `sessions.plan` writes them) merged over it, nested keys
        included, and validated again."""
        changes = [c for c in changes if c]
        if not changes:
            return self
        return type(self).model_validate(OmegaConf.to_container(OmegaConf.merge(self.model_dump(), *changes)))
