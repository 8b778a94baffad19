"""Reading one data source (a local JSONL, JSON, CSV or Parquet file, the first three also gzipped, or a hub
dataset) as rows, each with its location; a row that cannot be read comes with its reason (`BadRow`), a file that
cannot be read at all is a `DataError` naming its path and the fix. Blank lines are not rows. A hub source with
`max_rows` is streamed and read no further than it needs."""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import datasets
import pandas as pd
import pyarrow

from tunix_pipeline.config import SourceParams
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.data.fields import BadRow, json_type, paths, top_column

# Canonical fields each format reads (optional ones may be absent or empty).
FORMAT_FIELDS = {
    "gsm8k": {"required": ["question", "answer"], "optional": []},
    "alpaca": {"required": ["instruction", "output"], "optional": ["input", "reasoning"]},
    "prompt_response": {"required": ["prompt", "response"], "optional": ["reasoning"]},
    "messages": {"required": ["messages"], "optional": []},
    # chosen/rejected: answer texts beside a `prompt`, or chat lists that include the prompt turns
    "preference": {"required": ["chosen", "rejected"], "optional": ["prompt"]},
    # an open-ended task (writing, summarising): the judge scores it; a reference, when there is one, is SFT's target
    "open": {"required": ["prompt"], "optional": ["reference"]},
}


class DataError(UserError, ValueError):
    """Bad input data: the message names the source, the location and the fix."""


# ---------------------------------------------------------------- reading
Rows = Iterator[tuple[str, dict | None, BadRow | None]]  # (location, row, why the row is unreadable)


def read_rows(source: SourceParams, seed: int) -> Rows:
    if source.hf is not None:
        yield from _read_hub(source, seed)
        return
    path = _checked_path(source)
    suffix = file_type(path)
    try:
        if suffix in (".jsonl", ".json"):
            yield from _json_rows(source, path)
        elif suffix == ".csv":
            yield from _csv_rows(source, path)
        else:
            yield from _parquet_rows(source, path)
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:  # only a gzipped file's stream breaks off this way
        raise _file_error(source, path, f"is a damaged or cut-short gzip file ({err}); copy it again, or "
                          "decompress what is left and point `path` at that") from None


def file_type(path: Path) -> str:
    """A data file's type by its name: `.jsonl`, `.json`, `.csv`, `.parquet`; a gzipped one's under its `.gz`."""
    suffixes = [s.lower() for s in path.suffixes]
    gzipped = len(suffixes) >= 2 and suffixes[-1] == ".gz" and suffixes[-2] != ".parquet"  # Parquet compresses inside
    return suffixes[-2] if gzipped else path.suffix.lower()


def _open(path: Path):
    """The file's bytes, decompressed when it is gzipped (`.gz`)."""
    return gzip.open(path, "rb") if path.suffix.lower() == ".gz" else path.open("rb")


def _read(path: Path) -> bytes:
    with _open(path) as f:
        return f.read()


def _file_error(source: SourceParams, where, problem: str) -> DataError:
    return DataError(f"source '{source.name}': {where} {problem}")


def _checked_path(source: SourceParams) -> Path:
    """The source's file, or a `DataError` for a path that is no readable file of a known type."""
    path = Path(source.path)
    if path.is_dir():
        inside = ", ".join(sorted(p.name for p in path.iterdir())[:5]) or "nothing"
        raise _file_error(source, path, f"is a directory, not a file; set `path` to one file in it (it holds {inside})")
    if not path.is_file():
        raise DataError(
            f"source '{source.name}': file not found: {path} "
            f"(paths are relative to the project root; fix `ingest.sources[].path`)"
        )
    if file_type(path) not in (".jsonl", ".json", ".csv", ".parquet"):
        raise _file_error(
            source, path, f"has an unsupported file type '{''.join(path.suffixes[-2:])}'; use .jsonl, .json, .csv or "
            ".parquet (the first three also gzipped: .jsonl.gz), or an `hf:` source"
        )
    try:
        with _open(path) as f:
            head = f.read(2)
    except OSError as err:  # no permission to read it; a `.gz` that is not gzipped
        what = f" as {file_type(path)} compressed with gzip" if path.suffix.lower() == ".gz" else ""
        raise _file_error(source, path, f"cannot be read{what} ({err})") from None
    if not head:
        raise _file_error(source, path, "is empty (0 bytes); add rows, or remove the source from `ingest.sources`")
    if head in (b"\xff\xfe", b"\xfe\xff"):
        raise _file_error(source, path, "is UTF-16 text; save it as UTF-8")
    return path


def _blank_file(source: SourceParams, path: Path) -> DataError:
    return _file_error(source, path, "holds only blank lines; add rows, or remove the source from `ingest.sources`")


def _json_rows(source: SourceParams, path: Path) -> Rows:
    """JSON lines (.jsonl, .json), or one JSON array of row objects (.json)."""
    with _open(path) as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        raise _blank_file(source, path)
    if first.lstrip(b"\xef\xbb\xbf \t").startswith(b"["):
        if file_type(path) == ".json":
            yield from _json_array_rows(source, path)
            return
        if isinstance(_load_json(path), list):
            raise _file_error(source, path, "is one JSON array, not JSON lines (one object per line): name it .json")
    with _open(path) as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            location = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                yield location, None, BadRow(
                    "not_utf8", f"not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1})"
                )
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                yield location, None, BadRow("invalid_json", f"invalid JSON ({err.msg} at column {err.colno})")
                continue
            except RecursionError:
                yield location, None, BadRow("invalid_json", "invalid JSON (nested too deeply)")
                continue
            if not isinstance(row, dict):
                yield location, None, BadRow("not_an_object", f"the line is {json_type(row)}, not an object of columns")
                continue
            yield location, row, None


def _load_json(path: Path):
    """The file as one JSON document (undecodable bytes kept as surrogates), or None when it is not one."""
    try:
        return json.loads(_read(path).decode("utf-8-sig", errors="surrogateescape"))
    except (ValueError, RecursionError):
        return None


def _json_array_rows(source: SourceParams, path: Path) -> Rows:
    """The elements of one JSON array, each with the line it starts on."""
    text = _read(path).decode("utf-8-sig", errors="surrogateescape")
    try:
        json.loads(text)  # the whole document first: one broken element breaks the array
    except json.JSONDecodeError as err:
        raise _file_error(
            source, path, f"is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); a .json file holds "
            "one JSON array of row objects, or one object per line"
        ) from None
    except RecursionError:
        raise _file_error(source, path, "is not valid JSON (nested too deeply)") from None
    decoder, separators = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, line, counted = text.index("[") + 1, 1, 0
    while True:
        pos = separators.match(text, pos).end()
        if text[pos] == "]":
            return
        row, end = decoder.raw_decode(text, pos)
        line, counted = line + text.count("\n", counted, pos), pos
        if isinstance(row, dict):
            yield f"{path}:{line}", row, None
        else:
            yield f"{path}:{line}", None, BadRow("not_an_object", f"the element is {json_type(row)}, not an object")
        pos = end


def _csv_rows(source: SourceParams, path: Path) -> Rows:
    csv.field_size_limit(2**31 - 1)  # a long document is a row too; the default 128 KiB cap would stop the file
    # undecodable bytes become surrogates, which `_text` reports as `not_utf8:<column>` for the columns used
    with io.TextIOWrapper(_open(path), encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.reader(f)
        header = next((cells for cells in reader if not _blank_cells(cells)), None)
        if header is None:
            raise _blank_file(source, path)
        check_columns(source, path, header)
        rows, last_line = 0, reader.line_num
        for cells in reader:
            start, last_line = last_line + 1, reader.line_num  # a quoted cell may span lines
            if _blank_cells(cells):
                continue
            rows += 1
            if len(cells) != len(header):
                yield f"{path}:{start}", None, BadRow(
                    "ragged_csv_row", f"{len(cells)} cell(s), the header has {len(header)} columns"
                )
            else:
                yield f"{path}:{start}", dict(zip(header, cells)), None
    if not rows:
        raise _file_error(source, path, "has a header but no rows")


def _blank_cells(cells: list[str]) -> bool:
    return not "".join(cells).strip()  # a blank line, or a spreadsheet's row of empty cells


def _parquet_rows(source: SourceParams, path: Path) -> Rows:
    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError, pyarrow.ArrowException) as err:
        raise _file_error(
            source, path, f"is not a readable Parquet file ({type(err).__name__}: {err}); write it again "
            "(e.g. DataFrame.to_parquet) or convert it to .jsonl"
        ) from None
    check_columns(source, path, [str(c) for c in frame.columns])
    if frame.empty:
        raise _file_error(source, path, "has no rows")
    for i, row in enumerate(frame.to_dict(orient="records")):
        yield f"{path}:row {i}", row, None


def _read_hub(source: SourceParams, seed: int) -> Rows:
    """A hub dataset's rows. With `max_rows` it is streamed: nothing is downloaded or prepared
    beyond the rows taken (the caller stops after `max_rows`), so later shards are never opened;
    without, the whole split is prepared once (and cached) as `datasets` does."""
    hf, where = source.hf, f"{source.hf.path}[{source.hf.split}]"
    streaming = source.max_rows is not None
    call = f"datasets.load_dataset({hf.path!r}, {hf.name!r}, split={hf.split!r}, streaming={streaming})"
    try:
        ds = datasets.load_dataset(
            hf.path, hf.name, split=hf.split, data_files=hf.data_files, revision=hf.revision, streaming=streaming
        )
        if hf.shuffle_buffer is not None:
            ds = ds.shuffle(seed=seed, buffer_size=hf.shuffle_buffer)
    except Exception as err:  # the hub and the builders raise many types
        raise DataError(f"source '{source.name}': {call} failed: {err}") from err
    columns = ds.column_names  # None when a streamed builder does not know its schema before the first row
    if columns is not None:
        check_columns(source, where, columns)
    rows = iter(ds)
    for i in itertools.count():
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as err:  # a streamed shard is opened (downloaded, parsed) only here
            raise DataError(f"source '{source.name}': {call} failed at row {i}: {err}") from err
        if columns is None:
            columns = list(row)
            check_columns(source, where, columns)
        yield f"{where}:row {i}", row, None


def selection(source: SourceParams, seed: int) -> dict:
    """Where a source's rows came from and which of them were read (the data-quality report's `read`)."""
    if source.hf is None:
        read = {"location": source.path}
    else:
        hf = source.hf
        read = {"location": f"{hf.path}[{hf.split}]", "config": hf.name, "revision": hf.revision,
                "streamed": source.max_rows is not None}
    if source.max_rows is None:
        read["rows"] = "all rows"
    elif source.hf is not None and source.hf.shuffle_buffer is not None:
        buffer = source.hf.shuffle_buffer  # `datasets` fills it from up to 10 shards at a time, in a seeded order
        read["rows"] = (f"{source.max_rows} rows through a shuffle buffer of {buffer} (seed {seed}) filled from shards "
                        f"in a seeded order; about {source.max_rows + buffer} rows read")
    else:
        read["rows"] = f"the first {source.max_rows} rows"
    return read


def check_columns(source: SourceParams, where, columns: list[str]) -> None:
    """A file with a schema (CSV header, Parquet, hub dataset) must hold the columns the format's required fields
    read (a nested `a.b` field needs its column `a`; a template each column it names)."""
    required = FORMAT_FIELDS[source.format]["required"]
    specs = {field: source.columns.get(field, field) for field in required}
    missing = {field: [c for c in map(lambda p: top_column(p, columns), paths(spec)) if c not in columns]
               for field, spec in specs.items()}
    missing = {field: absent for field, absent in missing.items() if absent}
    if not missing:
        return
    shown = ", ".join(map(repr, columns[:20])) + (f" and {len(columns) - 20} more" if len(columns) > 20 else "")
    absent = ", ".join(repr(c) for field in missing for c in missing[field])
    problem = f"has no column(s) {absent} for format '{source.format}'; its columns are {shown}. "
    if any(field in source.columns for field in missing):
        raise _file_error(source, where, problem + "Fix `columns:` in this source's config: "
                          + ", ".join(f"{f}: {specs[f]!r}" for f in missing if f in source.columns) + ".")
    # a mapping that would fix it: the missing fields onto the columns nothing reads yet, in order
    spare = [c for c in columns if c not in source.columns.values() and c not in required]
    mapping = {**source.columns, **{field: spare.pop(0) if spare else "<column>" for field in missing}}
    raise _file_error(
        source, where, problem + "Map them in this source's config, e.g. "
        f"`columns: {{{', '.join(f'{k}: {json.dumps(v)}' for k, v in mapping.items())}}}`"
    )

