"""The project's pipelines: one per package under `pipelines/` (Kedro finds them), and those that join several:
the real DAG (`__default__`), `smoke` and `grpo`."""

from kedro.framework.project import find_pipelines
from kedro.framework.project import pipelines as project_pipelines
from kedro.pipeline import Pipeline

from tunix_pipeline.stages import POLISH

# packages that are no stage of the run: the plan comes before any hardware, the smoke checks only in `smoke`
NOT_STAGES = ("plan", "smoke")


def register_pipelines() -> dict[str, Pipeline]:
    # Kedro would find only the packages a run names (`--pipelines=grpo`: `grpo` alone), but `grpo`, `smoke` and
    # the DAG join several, so every package is found whichever the run names
    project_pipelines.set_requested(None)
    found = find_pipelines(raise_errors=True)  # a package that fails to load fails the run, not its pipeline only
    del found["__default__"]  # Kedro's: empty, as the package has no `pipeline` module
    dag = sum((pipeline for name, pipeline in found.items() if name not in NOT_STAGES), Pipeline([]))
    # `--pipelines=<polish stage>` runs the polish stages before it too (each a pass-through when it is off), so the
    # stage always has its parent's policy to start from: `grpo` is preference then GRPO
    chains = {stage.name: sum((found[s.name] for s in POLISH[: POLISH.index(stage) + 1]), Pipeline([]))
              for stage in POLISH}
    return {**found, **chains, "smoke": dag + found["smoke"], "__default__": dag}
