"""A terminal worth reading (`tunix_pipeline.core.quiet`); the smoke run's own terminal: tests/test_smoke.py."""

import logging
import re
import subprocess
import sys
import warnings

import pytest

from tunix_pipeline.core import quiet


LOG_LINE = re.compile(r"^LOG\|(WARNING|ERROR|CRITICAL)\|([^|]*)\|([^|]*)\|(.*)$")
PY_WARNING = re.compile(r"^(\S+?):(\d+): (\w*Warning): (.*)$")


def upstream_complaints(output: str) -> list[str]:
    """Python warnings and WARNING (or worse) log lines in `output` that do not come from the project."""
    found = []
    for line in output.splitlines():
        if (m := LOG_LINE.match(line)) and not m.group(2).startswith("tunix_pipeline"):
            found.append(line)
        elif (m := PY_WARNING.match(line)) and "/tunix_pipeline/" not in m.group(1):
            found.append(line)
    return found


def test_each_listed_line_is_dropped_only_from_its_own_module():
    for known in quiet.LOG_LINES:
        logger = logging.getLogger(known.logger)
        quiet.install()
        quiet.install()  # twice: one filter per logger
        assert sum(isinstance(f, quiet._DropKnown) for f in logger.filters) == 1

        def record(path, message):
            return logger.makeRecord(known.logger, logging.WARNING, path, 1, message, None, None)

        assert not logger.filter(record(f"/site-packages/{known.path}", known.message)), known
        assert logger.filter(record("/site-packages/other/module.py", known.message)), "another module says it"
        # another text: for a line matched by its start, one that starts otherwise; else one that says more
        other = "Not " + known.message if known.prefix else known.message + " (and more)"
        assert logger.filter(record(f"/site-packages/{known.path}", other)), "another text"
        if known.prefix:
            assert not logger.filter(record(f"/site-packages/{known.path}", known.message + " (and more)")), known
    for known in quiet.WARNINGS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet.install()
            warnings.warn_explicit(known.message, known.category, "x.py", 1, module=known.module)
            warnings.warn_explicit(known.message, known.category, "x.py", 1, module="some.other.module")
            warnings.warn_explicit(known.message + "!", known.category, "x.py", 1, module=known.module)
        assert [str(w.message) for w in caught] == [known.message, known.message + "!"], known
    assert all(entry.reason for entry in (*quiet.LOG_LINES, *quiet.WARNINGS))


# transformers imported as if torch were not installed (it is in the test extra)
WITHOUT_TORCH = """
import importlib.util, sys
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "torch" else find_spec(name, *a, **k)
sys.modules["torch"] = None
if sys.argv[1] == "quiet":
    from tunix_pipeline.core import quiet
    quiet.install()
import transformers
"""


@pytest.mark.parametrize("mode", ["loud", "quiet"])
def test_transformers_without_torch_is_quiet_once_installed(mode):
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, mode], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("PyTorch was not found" in result.stderr) == (mode == "loud"), result.stderr[-3000:]


def test_the_complaint_parser_sees_what_it_should():
    output = "\n".join([
        "LOG|WARNING|absl|/x/tunix/models/foo.py|something new",
        "LOG|WARNING|tunix_pipeline.run.hooks|/x/hooks.py|our own warning",
        "LOG|INFO|mlflow.store|/x/y.py|info is fine",
        "/x/site-packages/lib/mod.py:12: FutureWarning: going away",
        "/x/src/tunix_pipeline/mod.py:3: UserWarning: ours",
        "WARNING: Logging before InitGoogle() is written to STDERR",  # C++ (libtpu): no Python record
    ])
    assert upstream_complaints(output) == [
        "LOG|WARNING|absl|/x/tunix/models/foo.py|something new",
        "/x/site-packages/lib/mod.py:12: FutureWarning: going away",
    ]
