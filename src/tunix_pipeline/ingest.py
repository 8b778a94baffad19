"""Reads data sources into one record schema, with a data-quality report.

Record schema: id, source, prompt (str or None), messages (list of
{role, content} or None), reasoning (str, may be empty), answer (str).
Every source row becomes a record, is counted as a duplicate, or is dropped
with its location (file and line), a stable reason slug (e.g.
`missing_column:answer`, the metric name) and a sentence for people;
`on_bad_row: fail` turns the first bad row into a `DataError` naming both.
A file that cannot be read as a whole (missing, empty, a directory, the wrong
format) is a `DataError` naming its path and the fix. Blank lines are not rows.
A hub source with `max_rows` is streamed and read no further than it needs.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import random
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from tunix_pipeline import answers
from tunix_pipeline.config import IngestParams, SourceParams
from tunix_pipeline.errors import UserError

RECORD_COLUMNS = ["id", "source", "prompt", "messages", "reasoning", "answer"]
# preference records: reasoning/answer are the chosen answer's, these the rejected one's
REJECTED_COLUMNS = ["rejected_reasoning", "rejected_answer"]
MAX_DROPPED_ROWS_IN_REPORT = 10_000  # per source; the counts stay exact beyond it

# Canonical fields each format reads (optional ones may be absent or empty).
FORMAT_FIELDS = {
    "gsm8k": {"required": ["question", "answer"], "optional": []},
    "alpaca": {"required": ["instruction", "output"], "optional": ["input", "reasoning"]},
    "prompt_response": {"required": ["prompt", "response"], "optional": ["reasoning"]},
    "messages": {"required": ["messages"], "optional": []},
    # chosen/rejected: answer texts beside a `prompt`, or chat lists that include the prompt turns
    "preference": {"required": ["chosen", "rejected"], "optional": ["prompt"]},
}
ROLES = ("system", "user", "assistant")
_NOT_UTF8 = re.compile("[\ud800-\udfff]")  # undecodable bytes (surrogateescape) or lone surrogates from JSON escapes
_SLUG_WORD = re.compile(r"[A-Za-z0-9_-]{1,32}")
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


class DataError(UserError, ValueError):
    """Bad input data: the message names the source, the location and the fix."""


class BadRow(ValueError):
    """One row that cannot be mapped: `reason` is a stable slug (a metric name), the message a sentence."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------- reading
Rows = Iterator[tuple[str, dict | None, BadRow | None]]  # (location, row, why the row is unreadable)


def _read_rows(source: SourceParams, seed: int) -> Rows:
    if source.hf is not None:
        yield from _read_hub(source, seed)
        return
    path = _checked_path(source)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from _json_rows(source, path)
    elif suffix == ".csv":
        yield from _csv_rows(source, path)
    else:
        yield from _parquet_rows(source, path)


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
    if path.suffix.lower() not in (".jsonl", ".json", ".csv", ".parquet"):
        raise _file_error(
            source, path, f"has an unsupported file type '{path.suffix}'; use .jsonl, .json, .csv or .parquet, "
            "or an `hf:` source"
        )
    with path.open("rb") as f:
        head = f.read(2)
    if not head:
        raise _file_error(source, path, "is empty (0 bytes); add rows, or remove the source from `ingest.sources`")
    if head in (b"\xff\xfe", b"\xfe\xff"):
        raise _file_error(source, path, "is UTF-16 text; save it as UTF-8")
    return path


def _blank_file(source: SourceParams, path: Path) -> DataError:
    return _file_error(source, path, "holds only blank lines; add rows, or remove the source from `ingest.sources`")


def _json_rows(source: SourceParams, path: Path) -> Rows:
    """JSON lines (.jsonl, .json), or one JSON array of row objects (.json)."""
    with path.open("rb") as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        raise _blank_file(source, path)
    if first.lstrip(b"\xef\xbb\xbf \t").startswith(b"["):
        if path.suffix.lower() == ".json":
            yield from _json_array_rows(source, path)
            return
        if isinstance(_load_json(path), list):
            raise _file_error(source, path, "is one JSON array, not JSON lines (one object per line): name it .json")
    with path.open("rb") as f:
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
                yield location, None, BadRow("not_an_object", f"the line is {_json_type(row)}, not an object of columns")
                continue
            yield location, row, None


def _load_json(path: Path):
    """The file as one JSON document (undecodable bytes kept as surrogates), or None when it is not one."""
    try:
        return json.loads(path.read_bytes().decode("utf-8-sig", errors="surrogateescape"))
    except (ValueError, RecursionError):
        return None


def _json_array_rows(source: SourceParams, path: Path) -> Rows:
    """The elements of one JSON array, each with the line it starts on."""
    text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
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
            yield f"{path}:{line}", None, BadRow("not_an_object", f"the element is {_json_type(row)}, not an object")
        pos = end


def _csv_rows(source: SourceParams, path: Path) -> Rows:
    csv.field_size_limit(2**31 - 1)  # a long document is a row too; the default 128 KiB cap would stop the file
    # undecodable bytes become surrogates, which `_text` reports as `not_utf8:<column>` for the columns used
    with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.reader(f)
        header = next((cells for cells in reader if not _blank_cells(cells)), None)
        if header is None:
            raise _blank_file(source, path)
        _check_columns(source, path, header)
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
    import pyarrow

    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError, pyarrow.ArrowException) as err:
        raise _file_error(
            source, path, f"is not a readable Parquet file ({type(err).__name__}: {err}); write it again "
            "(e.g. DataFrame.to_parquet) or convert it to .jsonl"
        ) from None
    _check_columns(source, path, [str(c) for c in frame.columns])
    if frame.empty:
        raise _file_error(source, path, "has no rows")
    for i, row in enumerate(frame.to_dict(orient="records")):
        yield f"{path}:row {i}", row, None


def _read_hub(source: SourceParams, seed: int) -> Rows:
    """A hub dataset's rows. With `max_rows` it is streamed: nothing is downloaded or prepared
    beyond the rows taken (the caller stops after `max_rows`), so later shards are never opened;
    without, the whole split is prepared once (and cached) as `datasets` does."""
    import datasets

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
        _check_columns(source, where, columns)
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
            _check_columns(source, where, columns)
        yield f"{where}:row {i}", row, None


def _selection(source: SourceParams, seed: int) -> dict:
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


def _digest_row(digest, row: dict | None, unreadable: BadRow | None) -> None:
    """Adds one row as read (canonical JSON; an unreadable one as its reason) to `digest`."""
    item = {"unreadable": unreadable.reason} if row is None else row
    text = json.dumps(item, sort_keys=True, default=_plain)  # ASCII: surrogates from bad bytes stay escaped
    digest.update(text.encode() + b"\n")


def _plain(value):
    if isinstance(value, bytes):
        return value.hex()
    return value.tolist() if hasattr(value, "tolist") else str(value)  # numpy values and arrays from Parquet


def _check_columns(source: SourceParams, where, columns: list[str]) -> None:
    """A file with a schema (CSV header, Parquet, hub dataset) must hold the format's required columns."""
    required = FORMAT_FIELDS[source.format]["required"]
    missing = [field for field in required if source.columns.get(field, field) not in columns]
    if not missing:
        return
    # a mapping that would fix it: the missing fields onto the columns nothing reads yet, in order
    spare = [c for c in columns if c not in source.columns.values() and c not in FORMAT_FIELDS[source.format]["required"]]
    mapping = {**source.columns, **{field: spare.pop(0) if spare else "<column>" for field in missing}}
    shown = ", ".join(map(repr, columns[:20])) + (f" and {len(columns) - 20} more" if len(columns) > 20 else "")
    raise _file_error(
        source, where,
        f"has no column(s) {', '.join(repr(source.columns.get(f, f)) for f in missing)} for format '{source.format}'; "
        f"its columns are {shown}. Map them in this source's config, e.g. "
        f"`columns: {{{', '.join(f'{k}: {json.dumps(v)}' for k, v in mapping.items())}}}`"
    )


def _json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


# ---------------------------------------------------------------- mapping
def _text(row: dict, column: str, required: bool) -> str:
    if column not in row:
        if required:
            raise BadRow(f"missing_column:{column}", f"missing column '{column}'")
        return ""
    value = row[column]
    if value is None or (isinstance(value, float) and value != value):  # None or NaN
        if required:
            raise BadRow(f"null_field:{column}", f"'{column}' is null")
        return ""
    if not isinstance(value, str):
        raise BadRow(f"wrong_type:{column}", f"'{column}' is {_json_type(value)}, expected text")
    if _NOT_UTF8.search(value):
        raise BadRow(f"not_utf8:{column}", f"'{column}' holds bytes that are not UTF-8 text")
    if required and not value.strip():
        raise BadRow(f"empty_field:{column}", f"'{column}' is empty")
    return value.strip()


def split_completion(text: str) -> tuple[str, str]:
    """(reasoning, answer) from a completion: tagged, GSM8K `#### x`, or plain answer."""
    tagged = answers.parse(text)
    if tagged:
        return tagged
    if "####" in text:
        reasoning, _, answer = text.rpartition("####")
        answer = answer.strip()
        # GSM8K's marker ends the text with one line; prose (e.g. a legal answer in Markdown) may
        # hold "#### Heading" followed by more lines: that is not a final answer, keep the text whole
        if "\n" not in answer:
            answer = answer.replace(",", "")
            if not answer:
                raise BadRow("empty_answer", "nothing after '####'")
            return reasoning.strip(), answer
    return "", text.strip()


def _map_row(row: dict, source: SourceParams) -> dict:
    fields = FORMAT_FIELDS[source.format]
    col = {f: source.columns.get(f, f) for f in fields["required"] + fields["optional"]}
    prompt, messages = None, None
    if source.format == "gsm8k":
        prompt = _text(row, col["question"], True)
        reasoning, answer = split_completion(_text(row, col["answer"], True))
    elif source.format in ("alpaca", "prompt_response"):
        if source.format == "alpaca":
            prompt = _text(row, col["instruction"], True)
            extra = _text(row, col["input"], False)
            prompt = f"{prompt}\n\n{extra}" if extra else prompt
            completion = _text(row, col["output"], True)
        else:
            prompt = _text(row, col["prompt"], True)
            completion = _text(row, col["response"], True)
        reasoning, answer = split_completion(completion)
        reasoning = _text(row, col["reasoning"], False) or reasoning
    elif source.format == "preference":
        return _map_pair(row, col)
    else:
        messages, reasoning, answer = _map_messages(row, col["messages"])
    if not answer:
        raise BadRow("empty_answer", "the answer is empty")
    return {"prompt": prompt, "messages": messages, "reasoning": reasoning, "answer": answer}


def _map_pair(row: dict, col: dict) -> dict:
    """A preference row: `prompt` with chosen/rejected texts, or chosen/rejected chats sharing their prompt turns."""
    chosen, rejected = row.get(col["chosen"]), row.get(col["rejected"])
    if isinstance(chosen, str) or isinstance(rejected, str) or chosen is None or rejected is None:
        chosen_reasoning, chosen_answer = split_completion(_text(row, col["chosen"], True))
        rejected_reasoning, rejected_answer = split_completion(_text(row, col["rejected"], True))
        prompt, messages = _text(row, col["prompt"], True), None
    else:  # the UltraFeedback-binarized shape: each side is the whole chat, prompt turns included
        messages, chosen_reasoning, chosen_answer = _map_messages(row, col["chosen"])
        rejected_turns, rejected_reasoning, rejected_answer = _map_messages(row, col["rejected"])
        if rejected_turns != messages:
            raise BadRow("prompt_mismatch", f"'{col['chosen']}' and '{col['rejected']}' differ before the answer")
        prompt = None
    if not chosen_answer or not rejected_answer:
        raise BadRow("empty_answer", f"the {'chosen' if not chosen_answer else 'rejected'} answer is empty")
    if (chosen_reasoning, chosen_answer) == (rejected_reasoning, rejected_answer):
        raise BadRow("same_answers", "the chosen and the rejected answer are the same")
    return {"prompt": prompt, "messages": messages, "reasoning": chosen_reasoning, "answer": chosen_answer,
            "rejected_reasoning": rejected_reasoning, "rejected_answer": rejected_answer}


def _map_messages(row: dict, column: str) -> tuple[list[dict], str, str]:
    if column not in row:
        raise BadRow(f"missing_column:{column}", f"missing column '{column}'")
    value = row[column]
    if hasattr(value, "tolist"):  # numpy arrays from Parquet
        value = value.tolist()
    if value is None:
        raise BadRow(f"null_field:{column}", f"'{column}' is null")
    if not isinstance(value, list):
        raise BadRow(f"wrong_type:{column}", f"'{column}' is {_json_type(value)}, expected a list of {{role, content}}")
    if not value:
        raise BadRow(f"empty_field:{column}", f"'{column}' is an empty list")
    messages = []
    for i, m in enumerate(value, start=1):
        if not isinstance(m, dict):
            raise BadRow(f"wrong_type:{column}", f"message {i} is {_json_type(m)}, expected an object {{role, content}}")
        role = m.get("role")
        if role not in ROLES:
            # the role names the slug when it is a word (e.g. ShareGPT's `human`), so the count says what to map
            named = isinstance(role, str) and _SLUG_WORD.fullmatch(role)
            raise BadRow(
                f"unknown_role:{role}" if named else "unknown_role",
                f"message {i} has role {role!r}; roles are {', '.join(ROLES)}",
            )
        messages.append({"role": role, "content": _text(m, "content", False)})
    if messages[-1]["role"] != "assistant":
        raise BadRow("no_assistant_turn", f"the last message is the {messages[-1]['role']}'s, not the assistant's answer")
    if not any(m["role"] == "user" for m in messages[:-1]):
        raise BadRow("no_user_turn", "no user message before the assistant's answer")
    reasoning, answer = split_completion(messages[-1]["content"])
    return messages[:-1], reasoning, answer


def _record_id(record: dict) -> str:
    key = [record["prompt"], record["messages"], record["answer"]]
    if "rejected_answer" in record:  # a pair is the same pair only with the same rejected answer
        key += [record["reasoning"], record["rejected_reasoning"], record["rejected_answer"]]
    key = json.dumps(key, sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the stage
def ingest(params: IngestParams) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """All sources -> (train records, eval records, data-quality report)."""
    rng = random.Random(params.seed)
    report = {"sources": {}, "totals": {}}
    train, evaluation, seen = [], [], set()
    for source in params.sources:
        stats = {"rows_read": 0, "kept": 0, "duplicates": 0, "dropped": Counter(), "dropped_rows": []}
        records, digest = [], hashlib.sha256()
        # islice asks for no row past max_rows: a stream opens no shard it does not need
        for location, row, unreadable in itertools.islice(_read_rows(source, params.seed), source.max_rows):
            stats["rows_read"] += 1
            _digest_row(digest, row, unreadable)
            try:
                if unreadable is not None:
                    raise unreadable
                record = _map_row(row, source)
            except BadRow as bad:
                if params.on_bad_row == "fail":
                    raise DataError(
                        f"source '{source.name}', {location}: {bad}. Fix the row, map the column "
                        f"with `columns:`, or set `ingest.on_bad_row: skip` to count and skip such rows."
                    ) from None
                stats["dropped"][bad.reason] += 1
                if len(stats["dropped_rows"]) < MAX_DROPPED_ROWS_IN_REPORT:
                    stats["dropped_rows"].append({"location": location, "reason": bad.reason, "message": str(bad)})
                continue
            record["id"] = _record_id(record)
            record["source"] = source.name
            if params.dedup and record["id"] in seen:
                stats["duplicates"] += 1
                continue
            seen.add(record["id"])
            records.append(record)

        rng.shuffle(records)
        n_eval = round(len(records) * params.eval_fraction)
        evaluation.extend(records[:n_eval])
        source_train = _apply_weight(records[n_eval:], source.weight, rng)
        train.extend(source_train)
        stats.update(
            kept=len(records),
            train_rows=len(source_train),
            eval_rows=n_eval,
            dropped_total=sum(stats["dropped"].values()),
            dropped=dict(stats["dropped"]),
            read={**_selection(source, params.seed), "sha256": digest.hexdigest()},
        )
        report["sources"][source.name] = stats

    empty = [name for name, s in report["sources"].items() if s["kept"] == 0]
    if empty:
        raise DataError("these sources gave no usable rows: " + "; ".join(
            _no_rows(source, report["sources"][source.name]) for source in params.sources if source.name in empty
        ))
    rng.shuffle(train)
    report["totals"] = {
        "rows_read": sum(s["rows_read"] for s in report["sources"].values()),
        "kept": sum(s["kept"] for s in report["sources"].values()),
        "dropped": sum(s["dropped_total"] for s in report["sources"].values()),
        "duplicates": sum(s["duplicates"] for s in report["sources"].values()),
        "train_rows": len(train),
        "eval_rows": len(evaluation),
    }
    columns = RECORD_COLUMNS + (REJECTED_COLUMNS if params.sources[0].format == "preference" else [])
    return _frame(train, columns), _frame(evaluation, columns), report


def _no_rows(source: SourceParams, stats: dict) -> str:
    where = source.path if source.path is not None else f"{source.hf.path}[{source.hf.split}]"
    text = f"'{source.name}' ({where}): {stats['rows_read']} rows read, dropped {stats['dropped'] or 'none'}"
    if stats["dropped_rows"]:
        first = stats["dropped_rows"][0]
        text += f" (first: {first['location']}: {first['message']})"
    return text


def _apply_weight(records: list[dict], weight: float, rng: random.Random) -> list[dict]:
    """weight 2 repeats every row twice, 0.5 keeps a seeded half, 1.5 one copy plus half."""
    whole, fraction = int(weight), weight - int(weight)
    out = records * whole
    out += rng.sample(records, round(len(records) * fraction))
    return out


def _frame(records: list[dict], columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame(records, columns=columns)


def conversation(record: dict) -> list[dict]:
    """A record's prompt side as chat messages (records carry a prompt or messages)."""
    messages = record.get("messages")
    if hasattr(messages, "tolist"):
        messages = messages.tolist()
    if isinstance(messages, list) and messages:
        return [dict(m) for m in messages]
    return [{"role": "user", "content": record["prompt"]}]


def record_texts(records: pd.DataFrame) -> Iterator[str]:
    """Every text of the records, e.g. to train a tokenizer on."""
    for record in records.to_dict(orient="records"):
        for message in conversation(record):
            yield message["content"]
        yield answers.render(record["reasoning"], record["answer"])
