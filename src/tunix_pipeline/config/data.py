"""Settings of the data stages: `ingest` (sources, bad rows, split), `format` and `tokenize`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tunix_pipeline.config.base import Strict


class HubDataset(Strict):
    """Arguments of `datasets.load_dataset(path, name, split=..., ...)`; with the source's `max_rows` it streams."""

    path: str
    name: str | None = None
    split: str = "train"
    data_files: str | list[str] | None = None
    revision: str | None = None
    # streamed rows pass through a buffer of this many, shuffled with `ingest.seed` (the shards' order too):
    # about max_rows + shuffle_buffer rows are read; null takes the first max_rows rows
    shuffle_buffer: int | None = Field(None, gt=0)


class SourceParams(Strict):
    name: str
    path: str | None = Field(None, description="local .jsonl/.json/.parquet/.csv file (.jsonl.gz: gzipped)")
    hf: HubDataset | None = None
    format: Literal["gsm8k", "alpaca", "messages", "prompt_response", "preference", "open"]
    # canonical field -> where it is in this source: a column (`problem`), a nested field (`data.problem`), or a
    # template over several (`"{Body} {Question}"`)
    columns: dict[str, str] = {}
    # GSM8K's calculator annotations (`48/2 = <<48/2=24>>24` -> `48/2 = 24`) out of the reasoning; null: on for
    # `format: gsm8k`, off for the others
    strip_calculator_annotations: bool | None = None
    weight: float = Field(1.0, gt=0, description="multiplies this source's share of train rows")
    max_rows: int | None = Field(None, gt=0)
    # a held-out test set (e.g. GSM8K's test.jsonl): every row goes to the eval records as split "test", none to
    # training, and training rows asking one of its questions are dropped
    eval_only: bool = False

    @model_validator(mode="after")
    def _one_location(self):
        if (self.path is None) == (self.hf is None):
            raise ValueError(f"source '{self.name}': set exactly one of `path` or `hf`")
        if self.eval_only and self.weight != 1:
            raise ValueError(f"source '{self.name}': `weight` scales a source's training rows and an `eval_only` "
                             "source has none; remove `weight` or `eval_only`")
        for field, spec in self.columns.items():
            if spec.count("{") != spec.count("}") or "{}" in spec:
                raise ValueError(f"source '{self.name}': columns.{field} = {spec!r} is not a column, a nested `a.b` field "
                                 "or a template such as \"{Body} {Question}\" (every `{` closed by `}`, a column in each)")
        if self.hf is not None and self.hf.shuffle_buffer is not None and self.max_rows is None:
            raise ValueError(
                f"source '{self.name}': hf.shuffle_buffer picks max_rows rows from a stream; set `max_rows`, or remove "
                "`shuffle_buffer` (a source read whole is shuffled anyway before the train/eval split)"
            )
        return self

    @property
    def strips_calculator_annotations(self) -> bool:
        if self.strip_calculator_annotations is None:
            return self.format == "gsm8k"
        return self.strip_calculator_annotations


class IngestParams(Strict):
    sources: list[SourceParams] = Field(min_length=1)
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    seed: int = 0
    dedup: bool = True
    on_bad_row: Literal["skip", "fail"] = "skip"

    @model_validator(mode="after")
    def _unique_names(self):
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        if all(s.eval_only for s in self.sources):
            raise ValueError(f"every source ({', '.join(names)}) sets `eval_only: true`; at least one must be a "
                             "training source (without `eval_only`)")
        pairs = [s.name for s in self.sources if s.format == "preference"]
        if pairs and len(pairs) != len(self.sources):
            raise ValueError(
                f"sources {pairs} hold preference pairs and the others single answers; list preference sources "
                "under `preference.data.sources`, the others under `ingest.sources`"
            )
        return self

class FormatParams(Strict):
    # auto: the tokenizer's own chat template if it has one, else Gemma's turn format
    chat_template: Literal["auto", "gemma"] = "auto"
    system_prompt: str | None = None


class TokenizeParams(Strict):
    max_length: int = Field(gt=8)
    overflow: Literal["truncate", "drop"] = "truncate"
    # several short examples per row (segment ids keep attention within each)
    pack: bool = False
    histogram_bins: int = Field(10, gt=0)
