"""Problems a user can fix: `UserError`, the base of them all, and `HarnessError`, which both `harness` and the
model it drives (`harness_lm`) raise, so it sits below the two."""


class UserError(Exception):
    """A problem the user can fix (data, configuration, model, mesh, plan); the message says what, where and how.

    `kedro run` prints only the message of these (see `tunix_pipeline.cli`); any other exception is a bug
    and keeps its traceback. Subclasses also derive from the builtin they replace (ValueError, RuntimeError).
    """


class HarnessError(UserError, ValueError):
    """lm-evaluation-harness cannot run as configured."""
