"""The run's machinery: the runtime and its processes, sessions, output paths, hooks into Kedro, the checks before
a run, user errors and what the terminal shows."""
