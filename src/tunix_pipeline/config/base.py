"""The base of every settings section."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown keys are errors (a typo such as `max_step` stops the run before it starts); a section is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def changed(self, *changes: dict | None):
        """This section with `changes` (a session's, as `sessions.plan` writes them) merged over it, nested keys
        included, and validated again."""
        from omegaconf import OmegaConf

        changes = [c for c in changes if c]
        if not changes:
            return self
        return type(self).model_validate(OmegaConf.to_container(OmegaConf.merge(self.model_dump(), *changes)))
