"""Project CLI: `kedro run` (and `python -m tunix_pipeline`) with user errors as one message.

A user error (`tunix_pipeline.core.errors.UserError`: bad data, a model that cannot load, a mesh
that cannot be built, a run that cannot fit; or parameters that fail validation) prints its
message and exits 1; its text already says what, where and how to fix it, so a screen of
traceback would only hide it. A full disk or quota, in any stage and whichever library wrote, is a user error
too (`disk_full.DiskFullError`: the folder, the bytes needed and free, the setting to change). A run a signal
stopped after saving (`TrainingInterrupted`: SIGTERM, Ctrl-C) prints one line naming the signal, the step, the
folder and the command that resumes, and exits 128 + the signal's number; a Ctrl-C anywhere else (an evaluation,
GRPO's screen) prints one line naming the command that takes up what was saved. Any other exception is a bug and keeps
its traceback; `kedro run --verbose` (or TUNIX_PIPELINE_TRACEBACK=1) shows one for every error.
"""

import os
import signal
import sys

import click
from kedro.framework.cli.project import run as kedro_run
from kedro.framework.project import settings
from kedro.validation.exceptions import ParameterValidationError

from tunix_pipeline.core.command import kedro_command
from tunix_pipeline.core.disk_full import disk_full_cause, disk_full_error
from tunix_pipeline.core.errors import TrainingInterrupted, UserError

USER_ERRORS = (UserError, ParameterValidationError)


def _tracebacks() -> bool:
    return os.environ.get("TUNIX_PIPELINE_TRACEBACK", "") not in ("", "0")


@click.group(name="tunix_pipeline")
def cli():
    """Commands of this project (they override Kedro's own of the same name)."""


def _run(verbose: bool = False, **kwargs):
    if verbose or _tracebacks():
        return kedro_run.callback(**kwargs)
    try:
        return kedro_run.callback(**kwargs)
    except USER_ERRORS as err:
        raise click.ClickException(str(err)) from None
    except TrainingInterrupted as err:
        click.echo(err.message(kedro_command({})), err=True)
        sys.exit(err.exit_status)
    except KeyboardInterrupt:  # outside training's own stop (an evaluation, GRPO's screen), or a second Ctrl-C
        for hook in settings.HOOKS:  # what Kedro does for an exception and not for an interrupt: the run ends KILLED
            getattr(hook, "interrupted", lambda: None)()
        click.echo(f"Ctrl-C: stopped. What was saved as it went (checkpoints, evaluation rows, GRPO's screened prompts) "
                   f"is taken up by the same command: {kedro_command({})}", err=True)
        sys.exit(128 + signal.SIGINT)
    except Exception as err:
        if disk_full_cause(err) is None:
            raise
        raise click.ClickException(str(disk_full_error(err, _run_params()))) from None


def _run_params() -> dict:
    """The failed run's resolved parameters, as the project's hooks read them when its context was created (they
    name the setting of the folder that filled up); empty before that."""
    return next((hook._params for hook in settings.HOOKS if getattr(hook, "_params", None)), {})


# Kedro's `run`, same options and help, with the error handling above (`--verbose`: tracebacks kept)
VERBOSE = click.Option(["--verbose", "-v"], is_flag=True, help="Keep the traceback of every error, and of a stop.")
run = click.Command("run", params=[*kedro_run.params, VERBOSE], callback=_run, help=kedro_run.help,
                    short_help=kedro_run.short_help)
cli.add_command(run)
