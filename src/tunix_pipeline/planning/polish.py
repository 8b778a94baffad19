"""The polish stages in the plan: each stage's settings as the plan counts them (this run's, or the first session's
that turns it on) and its planning module, `planning/<stage>.py`."""

from __future__ import annotations

import dataclasses
import importlib

from tunix_pipeline.stages import Stage


def stage_planning(stage: Stage):
    """A polish stage's planning module, `planning/<stage>.py`: its `add_stage` (its figures in the plan) and
    `markdown_section` (its section of the report). Found by the stage's name: a new stage needs no entry here."""
    return importlib.import_module(f"tunix_pipeline.planning.{stage.name}")


@dataclasses.dataclass(frozen=True)
class PlannedStage:
    """A polish stage as the plan counts it: its parameters as this run has them, or as the first session of
    `sessions.plan` that turns it on; that session's hours (None: this run's), and its parameter changes."""

    params: object
    session_hours: float | None = None
    session_changes: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, name: str, params, sessions: dict) -> PlannedStage:
        if params.enabled:
            return cls(params)
        for session in (sessions or {}).get("plan") or []:
            changes = session.get("params") or {}
            if (changes.get(name) or {}).get("enabled"):
                return cls(params.changed(changes[name]), session["hours"], changes)
        return cls(params)
