"""Outputs that a later pipeline reads when they are there (a Kedro node cannot take an optional input; these
inputs are always there, sometimes empty): `tokenize_report`, which the `plan` pipeline takes for the padding of the
run's rows, and `eval_samples`, the first evaluation's scored rows that a polish stage's evaluation pairs its policy
against, whether or not those stages have run in this output root."""

from __future__ import annotations

from typing import Any

from kedro_datasets.json import JSONDataset
from kedro_datasets.pandas import JSONDataset as TableDataset


class NoneWhileMissing:
    """A kedro-datasets dataset that loads as None while its file does not exist (saving is unchanged): what a run
    may read before any run wrote it."""

    def load(self) -> Any:
        return super().load() if self._exists() else None


class OptionalJSONDataset(NoneWhileMissing, JSONDataset):
    """`json.JSONDataset`, None while missing."""


class OptionalTableDataset(NoneWhileMissing, TableDataset):
    """`pandas.JSONDataset`, None while missing."""
