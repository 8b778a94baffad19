"""Reads data sources into one record schema, with a data-quality report.

Record schema: id, source, prompt (str or None), messages (list of
{role, content} or None), reasoning (str, may be empty), answer (str),
open_ended (bool: an `open` row, with no answer to match; its answer is its
reference's, empty when it has none), split ("train"; an eval record's is
"dev", carved from the training sources, or "test", an `eval_only` source's).
Every source row becomes a record, is counted as a duplicate, or is dropped
with its location (file and line), a stable reason slug (e.g.
`missing_column:answer`, the metric name) and a sentence for people;
`on_bad_row: fail` turns the first bad row into a `DataError` naming both.
A file that cannot be read as a whole (missing, empty, a directory, the wrong
format) is a `DataError` naming its path and the fix (reading files and the hub: `readers`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterator

import pandas as pd

from tunix_pipeline.config import IngestParams, SourceParams
from tunix_pipeline.data import answers, fields
from tunix_pipeline.data.fields import BadRow, json_type
from tunix_pipeline.data.readers import FORMAT_FIELDS, DataError, read_rows, selection

# split: "train", or for eval records "dev" (carved by `eval_fraction`) or "test" (an `eval_only` source's)
RECORD_COLUMNS = ["id", "source", "prompt", "messages", "reasoning", "answer", "open_ended", "split"]
# preference records: reasoning/answer are the chosen answer's, these the rejected one's
REJECTED_COLUMNS = ["rejected_reasoning", "rejected_answer"]
MAX_DROPPED_ROWS_IN_REPORT = 10_000  # per source; the counts stay exact beyond it

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}  # and its `system`, `user`, `assistant` as they are
TRANSCRIPT_ROLES = {"Human": "user", "Assistant": "assistant"}
_TRANSCRIPT_TURN = re.compile(r"\n\n(Human|Assistant): ?")
_SLUG_WORD = re.compile(r"[A-Za-z0-9_-]{1,32}")
_CALCULATOR = re.compile(r"<<[^<>\n]*>>")  # GSM8K's calculator annotation: `48/2 = <<48/2=24>>24`


def _digest_row(digest, row: dict | None, unreadable: BadRow | None) -> None:
    """Adds one row as read (canonical JSON; an unreadable one as its reason) to `digest`."""
    item = {"unreadable": unreadable.reason} if row is None else row
    text = json.dumps(item, sort_keys=True, default=_plain)  # ASCII: surrogates from bad bytes stay escaped
    digest.update(text.encode() + b"\n")


def _plain(value):
    if isinstance(value, bytes):
        return value.hex()
    return value.tolist() if hasattr(value, "tolist") else str(value)  # numpy values and arrays from Parquet


# ---------------------------------------------------------------- mapping
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
    wanted = FORMAT_FIELDS[source.format]
    col = {f: source.columns.get(f, f) for f in wanted["required"] + wanted["optional"]}
    prompt, messages = None, None
    if source.format == "gsm8k":
        prompt = fields.text(row, col["question"], True)
        reasoning, answer = split_completion(fields.text(row, col["answer"], True, numeric=True))
    elif source.format in ("alpaca", "prompt_response"):
        if source.format == "alpaca":
            prompt = fields.text(row, col["instruction"], True)
            extra = fields.text(row, col["input"], False)
            prompt = f"{prompt}\n\n{extra}" if extra else prompt
            completion = fields.text(row, col["output"], True, numeric=True)
        else:  # the prompt and response as text, or as chat turns (TRL's conversational prompt-completion)
            prompt, messages = _prompt(row, col["prompt"])
            completion = _completion(row, col["response"])
        reasoning, answer = split_completion(completion)
        reasoning = fields.text(row, col["reasoning"], False) or reasoning
    elif source.format == "preference":
        return _map_pair(row, col)
    elif source.format == "open":
        return _map_open(row, col)
    else:
        messages, reasoning, answer = _map_messages(row, col["messages"])
    if not answer:
        raise BadRow("empty_answer", "the answer is empty")
    return {"prompt": prompt, "messages": messages, "reasoning": reasoning, "answer": fields.plain_number(answer),
            "open_ended": False}


def _map_open(row: dict, col: dict) -> dict:
    """An open-ended row: a prompt (text, or chat turns: TRL's conversational prompt-only shape), and a reference
    (SFT's target) or none (a prompt for GRPO and evaluation)."""
    prompt, messages = _prompt(row, col["prompt"])
    reference = fields.text(row, col["reference"], False, numeric=True)
    reasoning, answer = split_completion(reference) if reference else ("", "")
    if reference and not answer:
        raise BadRow("empty_answer", f"the reference in '{col['reference']}' has an empty answer; "
                     "give its text, or leave it out for a prompt-only row")
    return {"prompt": prompt, "messages": messages, "reasoning": reasoning, "answer": answer, "open_ended": True}


def _map_pair(row: dict, col: dict) -> dict:
    """A preference row: chosen/rejected chats that hold their prompt turns (the UltraFeedback-binarized shape), or
    chosen/rejected answers (texts, or TRL's conversational shape: one assistant turn each) beside a `prompt` (text,
    or chat turns)."""
    chosen, rejected = _chat_value(row, col["chosen"]), _chat_value(row, col["rejected"])
    if chosen is None and rejected is None and col["prompt"] not in row:  # Anthropic HH-RLHF's transcripts
        chosen, rejected = _transcript(row.get(col["chosen"])), _transcript(row.get(col["rejected"]))
    chosen = None if chosen is None else _turns(chosen, col["chosen"])
    if chosen is not None and rejected is not None and any(t["role"] != "assistant" for t in chosen):
        messages, chosen_reasoning, chosen_answer = _answered(chosen)
        rejected_turns, rejected_reasoning, rejected_answer = _answered(_turns(rejected, col["rejected"]))
        if rejected_turns != messages:
            raise BadRow("prompt_mismatch", f"'{col['chosen']}' and '{col['rejected']}' differ before the answer")
        prompt = None
    else:
        chosen_reasoning, chosen_answer = split_completion(_completion(row, col["chosen"], numeric=False))
        rejected_reasoning, rejected_answer = split_completion(_completion(row, col["rejected"], numeric=False))
        prompt, messages = _prompt(row, col["prompt"])
    if not chosen_answer or not rejected_answer:
        raise BadRow("empty_answer", f"the {'chosen' if not chosen_answer else 'rejected'} answer is empty")
    if (chosen_reasoning, chosen_answer) == (rejected_reasoning, rejected_answer):
        raise BadRow("same_answers", "the chosen and the rejected answer are the same")
    return {"prompt": prompt, "messages": messages, "reasoning": chosen_reasoning, "answer": chosen_answer,
            "rejected_reasoning": rejected_reasoning, "rejected_answer": rejected_answer, "open_ended": False}


def _map_messages(row: dict, column: str) -> tuple[list[dict], str, str]:
    value = fields.lookup(row, column)
    if hasattr(value, "tolist"):  # numpy arrays from Parquet
        value = value.tolist()
    return _answered(_turns(value, column))


def _transcript(text) -> list[dict] | None:
    """The turns of a `\n\nHuman: ...\n\nAssistant: ...` transcript (Anthropic's HH-RLHF), else None."""
    parts = _TRANSCRIPT_TURN.split(text) if isinstance(text, str) else []
    if len(parts) < 5 or parts[0].strip():
        return None
    return [{"role": TRANSCRIPT_ROLES[who], "content": said.strip()} for who, said in zip(parts[1::2], parts[2::2])]


def _chat_value(row: dict, spec: str) -> list | None:
    """The value at `spec` when it is a list (chat turns), else None: a text, a template, or no such field."""
    if fields.paths(spec) != [spec]:
        return None
    try:
        value = fields.lookup(row, spec)
    except BadRow:
        return None
    value = value.tolist() if hasattr(value, "tolist") else value  # numpy arrays from Parquet
    return value if isinstance(value, list) else None


def _prompt(row: dict, spec: str) -> tuple[str | None, list[dict] | None]:
    """(prompt, messages): a text prompt, or chat turns that end with the user's."""
    turns = _chat_value(row, spec)
    if turns is None:
        return fields.text(row, spec, True), None
    messages = _turns(turns, spec)
    if messages[-1]["role"] != "user":
        raise BadRow(f"prompt_ends_with:{messages[-1]['role']}",
                     f"'{spec}' ends with the {messages[-1]['role']}'s turn; a prompt ends with the user's")
    return None, messages


def _completion(row: dict, spec: str, numeric: bool = True) -> str:
    """An answer's text: a text field, or one assistant turn (TRL's conversational completion)."""
    turns = _chat_value(row, spec)
    if turns is None:
        return fields.text(row, spec, True, numeric=numeric)
    messages = _turns(turns, spec)
    if [m["role"] for m in messages] != ["assistant"]:
        raise BadRow(f"completion_turns:{spec}", f"'{spec}' holds the turns of "
                     f"{', '.join(m['role'] for m in messages)}; a completion is one assistant turn")
    return messages[0]["content"]


def _turns(value, column: str) -> list[dict]:
    """Chat turns, `{role, content}` or ShareGPT's `{from: human | gpt | system, value}`, as `{role, content}`."""
    if value is None:
        raise BadRow(f"null_field:{column}", f"'{column}' is null")
    if not isinstance(value, list):
        raise BadRow(f"wrong_type:{column}", f"'{column}' is {json_type(value)}, expected a list of {{role, content}}")
    if not value:
        raise BadRow(f"empty_field:{column}", f"'{column}' is an empty list")
    messages = []
    for i, m in enumerate(value, start=1):
        if not isinstance(m, dict):
            raise BadRow(f"wrong_type:{column}", f"message {i} is {json_type(m)}, expected an object {{role, content}}")
        sharegpt = "role" not in m and "from" in m
        role = m["from"] if sharegpt else m.get("role")
        if sharegpt and isinstance(role, str):
            role = SHAREGPT_ROLES.get(role, role)
        if role not in ROLES:
            # the role names the slug when it is a word (e.g. ShareGPT's `human`), so the count says what to map
            named = isinstance(role, str) and _SLUG_WORD.fullmatch(role)
            raise BadRow(
                f"unknown_role:{role}" if named else "unknown_role",
                f"message {i} has role {role!r}; roles are {', '.join(ROLES)}",
            )
        messages.append({"role": role, "content": fields.text(m, "value" if sharegpt else "content", False)})
    return messages


def _answered(messages: list[dict]) -> tuple[list[dict], str, str]:
    """(the turns before the answer, reasoning, answer) of a chat that ends with the assistant's answer."""
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
    """All sources -> (train records, eval records, data-quality report).

    Eval records are split "dev" (carved from the training sources by `eval_fraction`) or "test" (the rows
    of `eval_only` sources). Those are read first, so that a training row asking one of their questions
    is left out wherever the source is listed.
    """
    rng = random.Random(params.seed)
    stats, train, dev, test, seen, held_out = {}, [], [], [], set(), set()
    for source in sorted(params.sources, key=lambda s: not s.eval_only):  # stable: list order within each
        records, source_stats = _source_records(source, params, seen, held_out)
        if source.eval_only:
            held_out.update(_question(r) for r in records)
            source_train, source_eval = [], _with_split(records, "test")
            test.extend(source_eval)
        else:
            rng.shuffle(records)
            n_eval = round(len(records) * params.eval_fraction)
            source_eval = _with_split(records[:n_eval], "dev")
            source_train = _apply_weight(_with_split(records[n_eval:], "train"), source.weight, rng)
            dev.extend(source_eval)
            train.extend(source_train)
        source_stats.update(
            kept=len(records),
            train_rows=len(source_train),
            eval_rows=len(source_eval),
            dropped_total=sum(source_stats["dropped"].values()),
            dropped=dict(source_stats["dropped"]),
            read=source_stats.pop("read"),  # last, as the report has always listed it
        )
        stats[source.name] = source_stats

    report = {"sources": {s.name: stats[s.name] for s in params.sources}}  # in the order configured
    empty = [source for source in params.sources if stats[source.name]["kept"] == 0]
    if empty:
        raise DataError("these sources gave no usable rows: " + "; ".join(_no_rows(s, stats[s.name]) for s in empty))
    rng.shuffle(train)
    report["totals"] = _totals(stats.values(), train=len(train), dev=len(dev), test=len(test))
    if report["totals"]["overlap_with_eval_only"]:
        overlaps = {name: s["overlap_with_eval_only"] for name, s in stats.items() if s.get("overlap_with_eval_only")}
        log.warning("left out of training %d rows whose question is an eval-only source's: %s",
                       report["totals"]["overlap_with_eval_only"], overlaps)
    columns = RECORD_COLUMNS + (REJECTED_COLUMNS if params.sources[0].format == "preference" else [])
    return _frame(train, columns), _frame(dev + test, columns), report


def _with_split(records: list[dict], split: str) -> list[dict]:
    for record in records:
        record["split"] = split
    return records


def _totals(sources, train: int, dev: int, test: int) -> dict:
    sources = list(sources)
    return {
        "rows_read": sum(s["rows_read"] for s in sources),
        "kept": sum(s["kept"] for s in sources),
        "dropped": sum(s["dropped_total"] for s in sources),
        "duplicates": sum(s["duplicates"] for s in sources),
        "overlap_with_eval_only": sum(s.get("overlap_with_eval_only", 0) for s in sources),
        "calculator_annotations_removed": sum(s.get("calculator_annotations", {}).get("removed", 0) for s in sources),
        "train_rows": train,
        "eval_rows": dev + test,
        "dev_rows": dev,
        "test_rows": test,
    }


def _question(record: dict) -> str:
    """What a record asks, to match it across sources: its user turns, whitespace collapsed, case-folded."""
    text = " ".join(m["content"] for m in conversation(record) if m["role"] == "user")
    return " ".join(text.split()).casefold()


def _source_records(source: SourceParams, params: IngestParams, seen: set, held_out: set) -> tuple[list[dict], dict]:
    """One source's records (not in `seen`, which grows; a training source's not asking a question in `held_out`)
    and its counts: rows read, duplicates, overlaps, drops by reason."""
    stats = {"eval_only": source.eval_only, "rows_read": 0, "kept": 0, "duplicates": 0}
    if not source.eval_only:
        stats["overlap_with_eval_only"] = 0
    stats.update(dropped=Counter(), dropped_rows=[])
    if source.strips_calculator_annotations:
        stats["calculator_annotations"] = {"rows": 0, "removed": 0}  # in the kept rows
    records, digest = [], hashlib.sha256()
    # islice asks for no row past max_rows: a stream opens no shard it does not need
    for location, row, unreadable in itertools.islice(read_rows(source, params.seed), source.max_rows):
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
        stripped = _strip_calculator_annotations(record) if source.strips_calculator_annotations else 0
        record["id"] = _record_id(record)
        record["source"] = source.name
        # a test question trained on would inflate the test score: checked before (and whatever) `dedup`
        if not source.eval_only and held_out and _question(record) in held_out:
            stats["overlap_with_eval_only"] += 1
            continue
        if params.dedup and record["id"] in seen:
            stats["duplicates"] += 1
            continue
        seen.add(record["id"])
        records.append(record)
        if stripped:
            stats["calculator_annotations"]["rows"] += 1
            stats["calculator_annotations"]["removed"] += stripped
    stats["read"] = {**selection(source, params.seed), "sha256": digest.hexdigest()}
    return records, stats


def _strip_calculator_annotations(record: dict) -> int:
    """Removes GSM8K's `<<48/2=24>>` from the record's reasoning texts (the result after it stays); how many."""
    removed = 0
    for key in ("reasoning", "rejected_reasoning"):
        if record.get(key):
            record[key], n = _CALCULATOR.subn("", record[key])
            removed += n
    return removed


def _no_rows(source: SourceParams, stats: dict) -> str:
    where = source.path if source.path is not None else f"{source.hf.path}[{source.hf.split}]"
    text = f"'{source.name}' ({where}): {stats['rows_read']} rows read, dropped {stats['dropped'] or 'none'}"
    if stats.get("overlap_with_eval_only"):
        text += f", {stats['overlap_with_eval_only']} asking an eval-only source's question"
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
        if record["answer"]:  # a prompt-only row has no completion
            yield answers.render(record["reasoning"], record["answer"])
