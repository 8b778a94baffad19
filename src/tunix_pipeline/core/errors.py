"""Problems a user can fix: `UserError`, the base of them all, and `HarnessError`, which both `harness` and the
model it drives (`harness_lm`) raise, so it sits below the two; and `TrainingInterrupted`, a run stopped by a signal
after saving, which the CLI prints as one line too."""

import signal


class UserError(Exception):
    """A problem the user can fix (data, configuration, model, mesh, plan); the message says what, where and how.

    `kedro run` prints only the message of these (see `tunix_pipeline.cli`); any other exception is a bug
    and keeps its traceback. Subclasses also derive from the builtin they replace (ValueError, RuntimeError).
    """


class ModelError(UserError, ValueError):
    """A model folder, id or setting that cannot be used; the message says how to fix it."""


class HarnessError(UserError, ValueError):
    """lm-evaluation-harness cannot run as configured."""


STOP_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}  # preemption; Ctrl-C, a notebook's interrupt


class TrainingInterrupted(RuntimeError):
    """A signal (`STOP_SIGNALS`) stopped training after a checkpoint was saved; the CLI prints it as one line."""

    def __init__(self, signal_name: str, step: int, checkpoint_dir: str):
        self.signal_name, self.step, self.checkpoint_dir = signal_name, step, checkpoint_dir
        super().__init__(self.message())

    def message(self, command: str | None = None) -> str:
        resume = f"resume with: {command}" if command else "rerun the same command to resume from it"
        return f"{self.signal_name}: saved a checkpoint at step {self.step} in {self.checkpoint_dir}; {resume}"

    def __reduce__(self):  # pickled whole (a parallel runner's worker)
        return type(self), (self.signal_name, self.step, self.checkpoint_dir)

    @property
    def exit_status(self) -> int:
        return 128 + STOP_SIGNALS[self.signal_name]  # the shell's convention for a process ended by a signal
