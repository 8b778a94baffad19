"""Reads data sources into one record schema, with a data-quality report.

Record schema: id, source, prompt (str or None), messages (list of
{role, content} or None), reasoning (str, may be empty), answer (str).
Every source row either becomes a record or is counted as dropped with a
reason and its location (file and line); `on_bad_row: fail` turns the first
bad row into a `DataError` naming both.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from tunix_pipeline.config import IngestParams, SourceParams

RECORD_COLUMNS = ["id", "source", "prompt", "messages", "reasoning", "answer"]
MAX_EXAMPLES_IN_REPORT = 20

# Canonical fields each format reads (optional ones may be absent or empty).
FORMAT_FIELDS = {
    "gsm8k": {"required": ["question", "answer"], "optional": []},
    "alpaca": {"required": ["instruction", "output"], "optional": ["input", "reasoning"]},
    "prompt_response": {"required": ["prompt", "response"], "optional": ["reasoning"]},
    "messages": {"required": ["messages"], "optional": []},
}
_TAGGED = re.compile(r"^\s*<reasoning>(.*?)</reasoning>\s*<answer>(.*?)</answer>\s*$", re.S)


class DataError(ValueError):
    """Bad input data: the message names the source, the location and the fix."""


class BadRow(ValueError):
    """One row that cannot be mapped; the reason is the message."""


# ---------------------------------------------------------------- reading
def _read_rows(source: SourceParams) -> Iterator[tuple[str, dict | None, str | None]]:
    """Yields (location, row, parse_error) for every row of a source."""
    if source.hf is not None:
        yield from _read_hub(source)
        return
    path = Path(source.path)
    if not path.is_file():
        raise DataError(
            f"source '{source.name}': file not found: {path} "
            f"(paths are relative to the project root; fix `ingest.sources[].path`)"
        )
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    yield f"{path}:{line_no}", None, f"invalid JSON ({err.msg})"
                    continue
                if not isinstance(row, dict):
                    yield f"{path}:{line_no}", None, "line is not a JSON object"
                    continue
                yield f"{path}:{line_no}", row, None
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                if None in row:  # more cells than header columns
                    yield f"{path}:{reader.line_num}", None, "more cells than header columns"
                    continue
                yield f"{path}:{reader.line_num}", row, None
    elif suffix == ".parquet":
        frame = pd.read_parquet(path)
        for i, row in enumerate(frame.to_dict(orient="records")):
            yield f"{path}:row {i}", row, None
    else:
        raise DataError(
            f"source '{source.name}': unsupported file type '{suffix}' for {path}; "
            "use .jsonl, .json (JSON lines), .csv or .parquet, or an `hf:` source"
        )


def _read_hub(source: SourceParams) -> Iterator[tuple[str, dict, None]]:
    import datasets

    hf = source.hf
    try:
        ds = datasets.load_dataset(
            hf.path, hf.name, split=hf.split, data_files=hf.data_files, revision=hf.revision
        )
    except Exception as err:  # the hub and the builders raise many types
        raise DataError(
            f"source '{source.name}': datasets.load_dataset({hf.path!r}, {hf.name!r}, "
            f"split={hf.split!r}) failed: {err}"
        ) from err
    for i, row in enumerate(ds):
        yield f"{hf.path}[{hf.split}]:row {i}", row, None


# ---------------------------------------------------------------- mapping
def _text(row: dict, column: str, required: bool) -> str:
    value = row.get(column)
    if value is None or (isinstance(value, float) and value != value):  # None or NaN
        if required:
            raise BadRow(f"missing column '{column}'")
        return ""
    if not isinstance(value, str):
        raise BadRow(f"column '{column}' is {type(value).__name__}, expected text")
    if required and not value.strip():
        raise BadRow(f"empty '{column}'")
    return value.strip()


def split_completion(text: str) -> tuple[str, str]:
    """(reasoning, answer) from a completion: tagged, GSM8K `#### x`, or plain answer."""
    tagged = _TAGGED.match(text)
    if tagged:
        return tagged.group(1).strip(), tagged.group(2).strip()
    if "####" in text:
        reasoning, _, answer = text.rpartition("####")
        answer = answer.strip()
        # GSM8K's marker ends the text with one line; prose (e.g. a legal answer in Markdown) may
        # hold "#### Heading" followed by more lines: that is not a final answer, keep the text whole
        if "\n" not in answer:
            answer = answer.replace(",", "")
            if not answer:
                raise BadRow("nothing after '####'")
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
    else:
        messages, reasoning, answer = _map_messages(row.get(col["messages"]), col["messages"])
    return {"prompt": prompt, "messages": messages, "reasoning": reasoning, "answer": answer}


def _map_messages(value, column: str) -> tuple[list[dict], str, str]:
    if hasattr(value, "tolist"):  # numpy arrays from Parquet
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise BadRow(f"'{column}' must be a non-empty list of {{role, content}} messages")
    messages = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in (
            "system",
            "user",
            "assistant",
        ):
            raise BadRow(f"'{column}' has a message without role (system/user/assistant) and text content")
        messages.append({"role": m["role"], "content": m["content"].strip()})
    if messages[-1]["role"] != "assistant":
        raise BadRow("the last message must be the assistant's answer")
    if not any(m["role"] == "user" for m in messages[:-1]):
        raise BadRow("no user message before the assistant's answer")
    reasoning, answer = split_completion(messages[-1]["content"])
    if not answer:
        raise BadRow("empty assistant answer")
    return messages[:-1], reasoning, answer


def _record_id(record: dict) -> str:
    key = json.dumps([record["prompt"], record["messages"], record["answer"]], sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the stage
def ingest(params: IngestParams) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """All sources -> (train records, eval records, data-quality report)."""
    rng = random.Random(params.seed)
    report = {"sources": {}, "totals": {}}
    train, evaluation, seen = [], [], set()
    for source in params.sources:
        stats = {"rows_read": 0, "kept": 0, "duplicates": 0, "dropped": Counter(), "examples": []}
        records = []
        for location, row, problem in _read_rows(source):
            if source.max_rows is not None and stats["rows_read"] >= source.max_rows:
                break
            stats["rows_read"] += 1
            try:
                if problem:
                    raise BadRow(problem)
                record = _map_row(row, source)
            except BadRow as bad:
                if params.on_bad_row == "fail":
                    raise DataError(
                        f"source '{source.name}', {location}: {bad}. Fix the row, map the column "
                        f"with `columns:`, or set `ingest.on_bad_row: skip` to count and skip such rows."
                    ) from None
                stats["dropped"][str(bad)] += 1
                if len(stats["examples"]) < MAX_EXAMPLES_IN_REPORT:
                    stats["examples"].append({"location": location, "reason": str(bad)})
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
        )
        report["sources"][source.name] = stats

    empty = [name for name, s in report["sources"].items() if s["kept"] == 0]
    if empty:
        details = "; ".join(
            f"'{n}': {report['sources'][n]['rows_read']} rows read, "
            f"dropped {report['sources'][n]['dropped'] or 'none'}"
            for n in empty
        )
        raise DataError(f"these sources gave no usable rows: {details}")
    rng.shuffle(train)
    report["totals"] = {
        "rows_read": sum(s["rows_read"] for s in report["sources"].values()),
        "kept": sum(s["kept"] for s in report["sources"].values()),
        "dropped": sum(s["dropped_total"] for s in report["sources"].values()),
        "duplicates": sum(s["duplicates"] for s in report["sources"].values()),
        "train_rows": len(train),
        "eval_rows": len(evaluation),
    }
    return _frame(train), _frame(evaluation), report


def _apply_weight(records: list[dict], weight: float, rng: random.Random) -> list[dict]:
    """weight 2 repeats every row twice, 0.5 keeps a seeded half, 1.5 one copy plus half."""
    whole, fraction = int(weight), weight - int(weight)
    out = records * whole
    out += rng.sample(records, round(len(records) * fraction))
    return out


def _frame(records: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(records, columns=RECORD_COLUMNS)


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
        yield f"<reasoning>{record['reasoning']}</reasoning><answer>{record['answer']}</answer>"
