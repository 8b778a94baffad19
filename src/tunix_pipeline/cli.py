"""Project CLI: `kedro run` (and `python -m tunix_pipeline`) with user errors as one message.

A user error (`tunix_pipeline.errors.UserError`: bad data, a model that cannot load, a mesh
that cannot be built, a run that cannot fit; or parameters that fail validation) prints its
message and exits 1; its text already says what, where and how to fix it, so a screen of
traceback would only hide it. Any other exception is a bug and keeps its traceback.
"""

import click
from kedro.framework.cli.project import run as kedro_run
from kedro.validation.exceptions import ParameterValidationError

from tunix_pipeline.errors import UserError

USER_ERRORS = (UserError, ParameterValidationError)


@click.group(name="tunix_pipeline")
def cli():
    """Commands of this project (they override Kedro's own of the same name)."""


def _run(**kwargs):
    try:
        return kedro_run.callback(**kwargs)
    except USER_ERRORS as err:
        raise click.ClickException(str(err)) from None


# Kedro's `run`, same options and help, with the error handling above
run = click.Command("run", params=kedro_run.params, callback=_run, help=kedro_run.help, short_help=kedro_run.short_help)
cli.add_command(run)
