"""A JSON report that a later pipeline reads when it is there: `tokenize_report`, which the `plan` pipeline takes
for the padding of the run's rows, whether or not the tokenize stage has run in this output root."""

from __future__ import annotations

from typing import Any

from kedro_datasets.json import JSONDataset


class OptionalJSONDataset(JSONDataset):
    """kedro-datasets' `json.JSONDataset` that loads as None while its file does not exist (a Kedro node cannot
    take an optional input; this input is always there, sometimes empty). Saving is unchanged."""

    def load(self) -> Any:
        return super().load() if self._exists() else None
