"""Training across sessions (seed 000: Kaggle gives 9 h a session, 20 h a week).

`sessions.plan` lists the sessions, each with its own parameters (new data, a
new optimizer schedule, GRPO on). Every `kedro run` starts the first session
the ledger (`<output_root>/sessions.json`) has not marked finished, from the
previous session's final checkpoint (`sft.init_from`), with its own checkpoint
folders. On a fresh machine the ledger and the parent checkpoint are read
from `sessions.previous_root` (e.g. a Kaggle dataset made of the last
session's output); the MLflow runs name their parent run and checkpoint.

Continuing is not resuming: a session that was interrupted (preempted, out of
time) resumes from its own checkpoints when run again, with its own optimizer
state and step; a new session starts from its parent's weights at step 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import OmegaConf
from pydantic import BaseModel, Field

from tunix_pipeline.config import Strict
from tunix_pipeline.config.base import Location
from tunix_pipeline.config.validation import validate_section
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.core.paths import is_uri, storage_path
from tunix_pipeline.stages import POLISH, SFT

LEDGER = "sessions.json"
# stored relative to the root when under it
PATH_KEYS = ("checkpoint_dir", *(f"{stage.name}_checkpoint_dir" for stage in POLISH), "base_model_dir")
WEEK_SECONDS = 7 * 24 * 3600


class Session(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    hours: float = Field(gt=0, description="the session's wall-clock budget; becomes sft.time_budget_hours")
    params: dict = {}  # parameter overrides for this session, e.g. {sft: {learning_rate: 1.0e-5}}


class CurrentSession(BaseModel):
    """What the loader chose; read by the hooks. Not for users to set."""

    index: int
    name: str
    hours: float
    parent: dict | None = None
    plan_done: bool = False


class SessionsParams(Strict):
    plan: list[Session] = []
    weekly_hours: float | None = Field(None, gt=0)
    # where an earlier session's outputs are, read-only (e.g. /kaggle/input/<dataset>, or gs://bucket/run)
    previous_root: Location | None = None
    current: CurrentSession | None = None


class SessionPlanDone(UserError, RuntimeError):
    """Every session of `sessions.plan` is finished."""


# ---------------------------------------------------------------- the ledger
class Ledger:
    """`sessions.json`: every run of a session (for the weekly budget) and each finished session."""

    def __init__(self, root: str | Path, data: dict | None = None):
        # a folder as given (a relative one stays relative in the paths handed on), or a URI (gs://bucket/run)
        self.root = storage_path(root, "runtime.output_root") if is_uri(root) else Path(root)
        self.data = data or {"runs": [], "finished": {}}

    @classmethod
    def load(cls, output_root: str | Path, previous_root: str | Path | None = None) -> Ledger:
        """This root's ledger, else the previous root's with its paths made absolute (they stay there)."""
        ledger = cls(output_root)
        if (ledger.root / LEDGER).is_file():
            ledger.data = json.loads((ledger.root / LEDGER).read_text())
            return ledger
        previous = storage_path(previous_root, "sessions.previous_root") if previous_root else None
        if previous and (previous / LEDGER).is_file():
            ledger.data = json.loads((previous / LEDGER).read_text())
            for entry in ledger.data["finished"].values():
                for key in PATH_KEYS:
                    if entry.get(key) and not _is_absolute(entry[key]):
                        entry[key] = str(previous / entry[key])
        return ledger

    def finished(self, name: str) -> dict | None:
        return self.data["finished"].get(name)

    def hours_this_week(self, now: float | None = None) -> float:
        now = now or time.time()
        return sum(r["seconds"] for r in self.data["runs"] if now - r["started"] < WEEK_SECONDS) / 3600

    def record_run(self, session: str, started: float, seconds: float, run_id: str | None, outcome: str) -> None:
        self.data["runs"].append(
            {"session": session, "started": started, "seconds": seconds, "run_id": run_id, "outcome": outcome}
        )
        self.save()

    def record_finished(self, index: int, session: str, entry: dict) -> None:
        entry = {"index": index, **entry, "finished": time.time()}
        root = storage_path(self.root)
        for key in PATH_KEYS:  # relative: the root may be attached elsewhere later
            if entry.get(key) and storage_path(entry[key]).is_relative_to(root):
                entry[key] = str(storage_path(entry[key]).relative_to(root))
        self.data["finished"][session] = entry
        self.save()

    def path_of(self, entry: dict, key: str) -> str | None:
        value = entry.get(key)
        return value if value is None or _is_absolute(value) else str(self.root / value)

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / (LEDGER + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.root / LEDGER)


def _is_absolute(path: str) -> bool:
    return is_uri(path) or Path(path).is_absolute()


# ---------------------------------------------------------------- choosing the session
def apply_current_session(params: dict, runtime_params: dict | None = None) -> dict:
    """`params` with the current session's overrides; `--params` still win. Unchanged without a plan."""
    sessions = validate_section(params, "sessions", SessionsParams)
    if not sessions.plan:
        return params
    ledger = Ledger.load(params["runtime"]["output_root"], sessions.previous_root)
    index = next((i for i, s in enumerate(sessions.plan) if not ledger.finished(s.name)), None)
    plan_done = index is None
    if plan_done:
        index = len(sessions.plan) - 1
    session = sessions.plan[index]
    parent = _parent(sessions.plan, index, ledger)
    overrides = {
        SFT.name: {
            "checkpoint_dir": f"{params[SFT.name]['checkpoint_dir']}/{session.name}",
            "time_budget_hours": session.hours,
            "init_from": parent["checkpoint_dir"] if parent else None,
        },
    }
    for stage in POLISH:  # each polish stage in the session's own folder, within its hours where it has a budget
        section = params.get(stage.name)
        if section is not None:
            overrides[stage.name] = {"checkpoint_dir": f"{section['checkpoint_dir']}/{session.name}"}
            if stage.time_budget:
                overrides[stage.name]["time_budget_hours"] = session.hours
    if parent and parent["base_model_dir"]:  # a model the pipeline built (tiny): the parent's, tokenizer and all
        overrides["model"] = {"source": parent["base_model_dir"]}
    current = CurrentSession(index=index, name=session.name, hours=session.hours, parent=parent, plan_done=plan_done)
    merged = OmegaConf.merge(params, overrides, session.params, runtime_params or {})
    result = OmegaConf.to_container(merged, resolve=True)
    result["sessions"]["current"] = current.model_dump()
    return result


def _parent(plan: list[Session], index: int, ledger: Ledger) -> dict | None:
    """The checkpoint the session starts from: the previous session's last stage: GRPO, preference, or SFT."""
    if index == 0:
        return None
    name = plan[index - 1].name
    entry = ledger.finished(name)
    stage = next((f"{s.name}_" for s in reversed(POLISH) if entry.get(f"{s.name}_checkpoint_dir")), "")
    return {
        "session": name,
        "checkpoint_dir": ledger.path_of(entry, f"{stage}checkpoint_dir"),
        "step": entry.get(f"{stage}step"),
        "run_id": entry.get("run_id"),
        "base_model_dir": ledger.path_of(entry, "base_model_dir"),
    }


def check_previous_root(output_root: str, previous_root: str | None) -> None:
    """A `sessions.previous_root` without a ledger would start the plan over from its first session, silently;
    it is read only while this output root has no ledger of its own."""
    if not previous_root or (Ledger(output_root).root / LEDGER).is_file():
        return
    previous = storage_path(previous_root, "sessions.previous_root")
    if not (previous / LEDGER).is_file():
        raise UserError(f"sessions.previous_root: no {LEDGER} in {previous}; point it at the runtime.output_root of "
                        "the earlier sessions (on Kaggle: the attached dataset holding it), or set it to null")


def brief(sessions: SessionsParams, ledger: Ledger, sft: dict) -> str:
    """One paragraph for the log: which session, from what, how long, against the week."""
    current = sessions.current
    lines = [f"session {current.index + 1} of {len(sessions.plan)} '{current.name}'"]
    if current.parent:
        p = current.parent
        lines.append(f"continues from session '{p['session']}' (step {p['step']} in {p['checkpoint_dir']}, "
                     f"MLflow run {p['run_id']})")
    else:
        lines.append("starts from the base model")
    if sft.get("max_steps") is None:
        lines.append(f"{sft['epochs']:g} epochs of SFT")
    else:
        lines.append(f"{sft['max_steps']} SFT steps" if sft["max_steps"] else "no SFT (the parent checkpoint passes on)")
    lines.append(f"budget {current.hours:g} h")
    if sessions.weekly_hours:
        used = ledger.hours_this_week()
        left = sessions.weekly_hours - used - current.hours
        lines.append(f"this week {used:.1f} h used of {sessions.weekly_hours:g} h, {left:.1f} h left after it")
    return "; ".join(lines)


def expectation(sessions: SessionsParams, ledger: Ledger, planned_hours: float) -> tuple[str, bool]:
    """The plan's estimate against the session's hours and the week's; True when it will not fit the session."""
    current = sessions.current
    message = f"session '{current.name}' expects about {planned_hours:.1f} h of SFT (plan) within its {current.hours:g} h"
    if sessions.weekly_hours:
        message += f"; the week has {sessions.weekly_hours - ledger.hours_this_week():.1f} h left"
    over = planned_hours > current.hours
    if over:
        message += "; it will stop in time to save a checkpoint, and the next run resumes it"
    return message, over


def over_weekly_budget(sessions: SessionsParams, ledger: Ledger) -> bool:
    if not sessions.weekly_hours:
        return False
    return ledger.hours_this_week() + sessions.current.hours > sessions.weekly_hours

