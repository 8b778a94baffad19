"""The base of every settings section."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown keys are errors (a typo such as `max_step` stops the run before it starts); a section is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
