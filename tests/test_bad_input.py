"""Bad input as users have it: generated malformed rows in every format and file type, broken files, the CLI.

The generator knows what each row it writes should become (kept, a duplicate, or dropped with which
reason) and on which line it lands; ingest must agree row by row. Most cases call `ingest` directly;
one Kedro session runs many generated files through the real pipeline with the MLflow hook on.
"""

import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project
from mlflow.utils.validation import _validate_metric_name, _validate_param_name, _validate_tag_name

from tunix_pipeline.config import IngestParams, SourceParams
from tunix_pipeline.data.ingest import ingest
from tunix_pipeline.data.readers import FORMAT_FIELDS, DataError
from tunix_pipeline.tracking.mlflow_runs import mlflow_name

KEDRO = str(Path(sys.executable).parent / "kedro")
FILE_TYPES = ("jsonl", "json_lines", "json_array", "csv", "parquet")
SUFFIX = {"jsonl": ".jsonl", "json_lines": ".json", "json_array": ".json", "csv": ".csv", "parquet": ".parquet"}
JSON_TYPES = ("jsonl", "json_lines", "json_array")
LINES = ("jsonl", "json_lines")  # JSON lines: a raw line may be anything
# CSV cells are text: chat messages need JSON or Parquet
COMBINATIONS = [(f, t) for f in FORMAT_FIELDS for t in FILE_TYPES if not (f == "messages" and t == "csv")]
BAD_BYTE = "\udcff"  # written as the raw byte 0xff (surrogateescape): not UTF-8
# no "<" or "#" (they would make a valid completion's answer differ), no "\r" (CSV line counts stay "\n"s)
TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="<#\r"), max_size=20)
# derandomized: CI sees the same cases every run; no example database written into the tree
SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@dataclass
class Row:
    payload: object  # a dict of columns; bytes: a raw JSON line; list: raw CSV cells; None: a blank line
    expect: str | None  # "kept", "duplicate", a drop reason; None for a blank line (not a row)
    marker: str | None = None  # the text that starts the prompt of a kept row


def _good(fmt: str, marker: str, text: str) -> dict:
    completion = f"<reasoning>{text}</reasoning><answer>{len(text)}</answer>"
    if fmt == "gsm8k":
        return {"question": f"{marker} {text}", "answer": f"{text}\n#### {len(text)}"}
    if fmt == "alpaca":
        return {"instruction": f"{marker} {text}", "input": text, "output": completion}
    if fmt == "prompt_response":
        return {"prompt": f"{marker} {text}", "response": completion}
    if fmt == "open":  # a reference, or none (a prompt-only row; its note keeps a CSV row with an empty prompt a row)
        return {"prompt": f"{marker} {text}", **({"reference": completion} if len(text) % 2 else {"note": "open"})}
    if fmt == "preference":  # the text shape; the chat shape is in tests/test_preference.py
        return {"prompt": f"{marker} {text}", "chosen": completion,
                "rejected": f"<reasoning>{text}</reasoning><answer>{len(text) + 1}</answer>"}
    return {"messages": [{"role": "system", "content": text}, {"role": "user", "content": f"{marker} {text}"},
                         {"role": "assistant", "content": completion}]}


ANSWER_COLUMNS = ("answer", "output", "response")


def _text_fields(fmt: str) -> list[str]:
    return FORMAT_FIELDS[fmt]["required"] if fmt != "messages" else []


def bad_kinds(fmt: str, ftype: str) -> list[str]:
    """The kinds of malformed row that this format and file type can hold."""
    kinds = ["empty", "empty_answer"]
    if ftype != "csv":  # CSV cells are text: no nulls, no types, no missing key in one row
        kinds += ["null"]
    if ftype in JSON_TYPES:
        kinds += ["missing", "wrong_type", "lone_surrogate", "bad_byte"]
    if ftype == "csv":
        kinds += ["bad_byte", "ragged"]
    if fmt == "preference":
        kinds += ["same_answers"]
    if fmt == "messages":
        kinds += ["unknown_role", "no_assistant", "no_user", "empty_content"]
        if ftype in JSON_TYPES:
            kinds += ["message_not_object", "content_wrong_type"]
    if ftype in LINES:
        kinds += ["broken_json", "deep"]
    if ftype in JSON_TYPES:
        kinds += ["not_object"]
    return kinds


@st.composite
def _bad_row(draw, fmt: str, ftype: str, good: dict, kind: str) -> tuple[object, str]:
    """A malformed variant of `good` of this kind, and the reason ingest should give."""
    row = json.loads(json.dumps(good))
    col = draw(st.sampled_from(_text_fields(fmt) or ["messages"]))
    if kind == "empty":
        row[col] = [] if col == "messages" else draw(st.sampled_from(["", " ", "\t \n"]))
        return row, f"empty_field:{col}"
    if kind == "null":
        row[col] = draw(st.sampled_from([None, float("nan")])) if ftype in JSON_TYPES and col != "messages" else None
        return row, f"null_field:{col}"
    if kind == "missing":
        del row[col]
        return row, f"missing_column:{col}"
    if kind == "wrong_type":
        numbers = [] if col in ANSWER_COLUMNS else [0, 2.5]  # an answer column may hold numbers (`51.0` is `51`)
        row[col] = draw(st.sampled_from(numbers + [True, {"text": "x"}] + ([] if col == "messages" else [["x"]])))
        return row, f"wrong_type:{col}"
    if kind == "lone_surrogate":  # a JSON escape that decodes to no character
        target = row["messages"][1] if fmt == "messages" else row
        key = "content" if fmt == "messages" else col
        target[key] += "\ud800"
        return row, f"not_utf8:{key}"
    if kind == "bad_byte":
        if fmt == "messages":
            row["messages"][1]["content"] += BAD_BYTE
            return row, "not_utf8" if ftype in LINES else "not_utf8:content"
        if draw(st.booleans()):  # in a column nothing reads: harmless, except that a JSON line is read whole
            row["note"] = BAD_BYTE
            return row, "not_utf8" if ftype in LINES else "kept"
        row[col] = row[col][:3] + BAD_BYTE + row[col][3:]
        return row, "not_utf8" if ftype in LINES else f"not_utf8:{col}"
    if kind == "empty_answer":
        if fmt == "gsm8k":
            row["answer"] = "2 + 2 = 4\n####  "
        elif fmt == "messages":
            row["messages"][-1]["content"] = "<reasoning>r</reasoning><answer> </answer>"
        elif fmt == "preference":
            row[col] = "<reasoning>r</reasoning><answer></answer>"
        elif fmt == "open":
            row["reference"] = "<reasoning>r</reasoning><answer></answer>"
        else:
            row["output" if fmt == "alpaca" else "response"] = "<reasoning>r</reasoning><answer></answer>"
        return row, "empty_answer"
    if kind == "same_answers":
        row["rejected"] = row["chosen"]
        return row, "same_answers"
    if kind == "unknown_role":
        roles = ["bot", "human", "User", "", "tool call"] + ([None, 5] if ftype in JSON_TYPES else [])
        role = draw(st.sampled_from(roles))
        row["messages"][draw(st.integers(0, 2))]["role"] = role
        named = isinstance(role, str) and re.fullmatch(r"[A-Za-z0-9_-]+", role)
        return row, f"unknown_role:{role}" if named else "unknown_role"
    if kind == "no_assistant":
        row["messages"] = row["messages"][:2]
        return row, "no_assistant_turn"
    if kind == "no_user":
        row["messages"] = [row["messages"][0], row["messages"][2]]
        return row, "no_user_turn"
    if kind == "empty_content":
        row["messages"][2]["content"] = None
        return row, "empty_answer"
    if kind == "message_not_object":
        row["messages"][draw(st.integers(0, 2))] = draw(st.sampled_from(["hi", 3, None, ["user", "hi"]]))
        return row, "wrong_type:messages"
    if kind == "content_wrong_type":
        row["messages"][1]["content"] = draw(st.sampled_from([3, ["hi"], {"text": "hi"}, False]))
        return row, "wrong_type:content"
    if kind == "broken_json":
        text = json.dumps(row, ensure_ascii=False)
        broken = draw(st.sampled_from([
            text[: draw(st.integers(1, len(text) - 1))],  # cut anywhere
            text[:-1] + ",}",  # trailing comma
            text.replace('"', "'"),  # Python quotes
            "{" + text,
        ]))
        return broken.encode(), "invalid_json"
    if kind == "not_object":
        value = draw(st.sampled_from([[1, 2], "text", 42, None, True, [row]]))
        return (json.dumps(value).encode() if ftype in LINES else value), "not_an_object"
    if kind == "deep":
        depth = draw(st.integers(10_000, 100_000))
        return ("[" * depth + "]" * depth).encode(), "invalid_json"
    if kind == "ragged":
        cells = _csv_cells(fmt, row)
        return (cells + ["extra"] if draw(st.booleans()) else cells[:-1]), "ragged_csv_row"
    raise AssertionError(kind)


@st.composite
def source_rows(draw, fmt: str, ftype: str, prefix: str = "r") -> list[Row]:
    """Rows for one file, in a drawn order after a good first row: every kind of malformed row
    this file type can hold (and a few more), good ones with odd text, padded or huge,
    duplicates, blank lines."""
    bad = bad_kinds(fmt, ftype)
    plan = bad + draw(st.lists(st.sampled_from(bad), max_size=3)) + ["good"] * draw(st.integers(0, 4)) \
        + ["duplicate"] * draw(st.integers(0, 3)) + ["padded"] * draw(st.integers(0, 2)) \
        + ["huge"] * draw(st.integers(0, 1)) + (["blank"] * draw(st.integers(0, 3)) if ftype in LINES + ("csv",) else [])
    rows, good_rows = [], []
    for i, kind in enumerate(["good", *draw(st.permutations(plan))]):
        marker = f"{prefix}{i}"
        good = _good(fmt, marker, draw(TEXT))
        if kind == "blank":
            rows.append(Row(None, None))
        elif kind == "duplicate":
            rows.append(Row(draw(st.sampled_from(good_rows)), "duplicate"))
        elif kind in bad:
            payload, expect = draw(_bad_row(fmt, ftype, good, kind))
            rows.append(Row(payload, expect, marker))
        else:
            if kind == "huge":  # more than the CSV module's default field limit (128 KiB)
                key = _text_fields(fmt)[0] if fmt != "messages" else None
                if key:
                    good[key] += " " + "x" * 200_000
                else:
                    good["messages"][1]["content"] += " " + "y" * 200_000
            elif kind == "padded":
                key = _text_fields(fmt)[0] if fmt != "messages" else None
                if key:
                    good[key] = f"  {good[key]}\n "
                good["note"] = "an extra column"
            rows.append(Row(good, "kept", marker))
            good_rows.append(good)
    return rows


def _csv_header(fmt: str) -> list[str]:
    return FORMAT_FIELDS[fmt]["required"] + FORMAT_FIELDS[fmt]["optional"] + ["note"]


def _csv_cells(fmt: str, row: dict) -> list[str]:
    return [row.get(c, "") for c in _csv_header(fmt)]


def _json_text(value) -> str:
    """JSON with the bad byte kept raw and other lone surrogates as escapes (both occur in real files)."""
    text = json.dumps(value, ensure_ascii=False)
    return re.sub("[\ud800-\udcfe\udd00-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", text)


def write_source(path: Path, fmt: str, ftype: str, rows: list[Row]) -> list[str | None]:
    """Writes the rows as `ftype`; returns each row's location as ingest should name it (None: blank)."""
    locations, text = [], ""
    if ftype == "parquet":
        pd.DataFrame([r.payload for r in rows]).to_parquet(path)
        return [f"{path}:row {i}" for i in range(len(rows))]
    if ftype == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(_csv_header(fmt))
        for r in rows:
            line = out.getvalue().count("\n") + 1
            if r.payload is None:
                out.write("\n" if line % 2 else ",,,\n")  # a blank line, or a spreadsheet's empty row
                locations.append(None)
                continue
            writer.writerow(r.payload if isinstance(r.payload, list) else _csv_cells(fmt, r.payload))
            locations.append(f"{path}:{line}")
        text = out.getvalue()
    elif ftype == "json_array":
        text = "["
        for i, r in enumerate(rows):
            text += ",\n" if i else "\n"
            line = text.count("\n") + 1
            locations.append(f"{path}:{line}")
            text += _json_text(r.payload)
        text += "\n]\n"
    else:
        for r in rows:
            line = text.count("\n") + 1
            if r.payload is None:
                text += "   \n"
                locations.append(None)
                continue
            raw = r.payload.decode() if isinstance(r.payload, bytes) else _json_text(r.payload)
            text += raw + "\n"
            locations.append(f"{path}:{line}")
    path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    return locations


def expected_report(rows: list[Row], locations: list[str | None]) -> dict:
    real = [(r, loc) for r, loc in zip(rows, locations) if r.expect is not None]
    dropped = [(loc, r.expect) for r, loc in real if r.expect not in ("kept", "duplicate")]
    return {
        "rows_read": len(real),
        "kept": sum(r.expect == "kept" for r, _ in real),
        "duplicates": sum(r.expect == "duplicate" for r, _ in real),
        "dropped_rows": dropped,
        "markers": sorted(r.marker for r, _ in real if r.expect == "kept"),
    }


def _markers(records: pd.DataFrame) -> list[str]:
    """The marker that starts each record's prompt (or its first user message)."""
    out = []
    for record in records.to_dict(orient="records"):
        messages = record["messages"]
        prompt = record["prompt"] if not isinstance(messages, list) else next(m for m in messages if m["role"] == "user")["content"]
        out.append(prompt.split()[0])
    return sorted(out)


def check_source(stats: dict, records: pd.DataFrame, want: dict) -> None:
    assert [(d["location"], d["reason"]) for d in stats["dropped_rows"]] == want["dropped_rows"]
    assert (stats["rows_read"], stats["kept"], stats["duplicates"]) == (want["rows_read"], want["kept"], want["duplicates"])
    assert stats["rows_read"] == stats["kept"] + stats["duplicates"] + stats["dropped_total"]
    assert sum(stats["dropped"].values()) == stats["dropped_total"] == len(want["dropped_rows"])
    assert _markers(records) == want["markers"]
    assert all(d["message"] and d["reason"] != d["message"] for d in stats["dropped_rows"])


@pytest.mark.parametrize(("fmt", "ftype"), COMBINATIONS)
@settings(max_examples=30, **SETTINGS)
@given(data=st.data())
def test_generated_rows_are_kept_counted_or_dropped_with_their_line(fmt, ftype, data):
    rows = data.draw(source_rows(fmt, ftype))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"data{SUFFIX[ftype]}"
        want = expected_report(rows, write_source(path, fmt, ftype, rows))
        params = IngestParams(sources=[SourceParams(name="generated", path=str(path), format=fmt)], eval_fraction=0.0)
        train, _, report = ingest(params)
        check_source(report["sources"]["generated"], train, want)
        # on_bad_row: fail stops at the first bad row and names its line
        if want["dropped_rows"]:
            location, _ = want["dropped_rows"][0]
            with pytest.raises(DataError, match=re.escape(f"source 'generated', {location}: ")):
                ingest(params.model_copy(update={"on_bad_row": "fail"}))


def _examples(strategy, n: int) -> list:
    """`n` examples of a strategy as @given draws them (derandomized: the same on every run).

    The first ones are the simplest (empty texts, fewest rows); a Kedro session is too slow to
    run per example, so it takes a later one.
    """
    found = []

    @settings(max_examples=n, phases=[Phase.generate], **SETTINGS)
    @given(strategy)
    def collect(value):
        found.append(value)

    collect()
    return found


@pytest.mark.slow
def test_generated_sources_through_kedro_with_mlflow(project):
    """Every format and file type in one `ingest` run, with MLflow on: it finishes, the report and metrics agree.

    (Preference pairs are ingested by the preference stage from `preference.data`, not by `ingest.sources`:
    `test_generated_rows_are_kept_counted_or_dropped_with_their_line` covers them.)
    """
    wants, sources = {}, []
    for k, (fmt, ftype) in enumerate(c for c in COMBINATIONS if c[0] != "preference"):
        rows = _examples(source_rows(fmt, ftype, prefix=f"s{k}r"), 8)[-1]
        path = Path("data/01_raw") / f"gen_{k}{SUFFIX[ftype]}"  # relative to the project, as users write them
        name = f"{fmt} ({ftype}, #{k})"  # characters MLflow refuses in metric names
        wants[name] = expected_report(rows, write_source(path, fmt, ftype, rows))
        sources.append({"name": name, "path": str(path), "format": fmt})
    (project / "conf" / "local" / "parameters.yml").write_text(json.dumps({"ingest": {"sources": sources}}))

    bootstrap_project(project)
    with KedroSession.create(project_path=project) as session:
        session.run(pipeline_names=["ingest"])

    report = json.loads((project / "data" / "08_reporting" / "data_quality.json").read_text())
    records = pd.concat([pd.read_json(project / "data" / "02_intermediate" / f"{split}_records.jsonl", lines=True,
                                      dtype=False) for split in ("train", "eval")])
    for name, want in wants.items():
        check_source(report["sources"][name], records[records["source"] == name], want)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    assert run.info.status == "FINISHED"
    for name, stats in report["sources"].items():
        for reason, count in stats["dropped"].items():
            assert run.data.metrics[mlflow_name(f"data_quality_report.sources.{name}.dropped.{reason}")] == count
    assert run.data.metrics["data_quality_report.totals.rows_read"] == sum(w["rows_read"] for w in wants.values())


@settings(max_examples=300, **SETTINGS)
@given(name=st.text(max_size=300))
def test_every_name_is_made_valid_for_mlflow(name):
    valid = mlflow_name(name)
    for validate in (_validate_metric_name, _validate_param_name, _validate_tag_name):
        validate(valid)
    assert len(valid) <= 250 and mlflow_name(valid) == valid
    if re.fullmatch(r"[A-Za-z0-9_\-.:]+(/[A-Za-z0-9_\-.:]+)*", name) and not name.startswith(".") and len(name) <= 250 \
            and all(part.strip(".") for part in name.split("/")):
        assert valid == name  # a valid name is left alone


def test_node_outputs_log_measurements_as_metrics_and_configuration_as_params(tmp_path):
    from tunix_pipeline.tracking.mlflow_runs import log_output

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        experiment = mlflow.create_experiment("outputs", artifact_location=str(tmp_path / "artifacts"))
        with mlflow.start_run(experiment_id=experiment) as run:
            for _ in range(2):  # a resumed run logs its outputs again
                log_output("base_model", {"family": "gemma", "architecture": {"num_layers": 2, "embed_dim": 64}})
                log_output("sft_result", {"last_loss": 0.5, "mesh": {"fsdp": 4, "tp": 2}, "micro_batch_size": 8})
                log_output("eval_metrics", {"tuned": {"pass@3": 0.75, "majority@3": 0.5}})
                log_output("data_quality_report", {"sources": {"web (2024), 'clean'": {"dropped": {"unknown_role:human": 3}}}})
        data = mlflow.MlflowClient().get_run(run.info.run_id).data
    finally:
        mlflow.set_tracking_uri(None)  # also unsets MLFLOW_TRACKING_URI, which the project's hooks read
    assert data.params == {"base_model.architecture.num_layers": "2", "base_model.architecture.embed_dim": "64",
                           "sft_result.mesh.fsdp": "4", "sft_result.mesh.tp": "2", "sft_result.micro_batch_size": "8"}
    assert data.metrics == {"sft_result.last_loss": 0.5, "eval_metrics.tuned.pass_3": 0.75,
                            "eval_metrics.tuned.majority_3": 0.5,
                            "data_quality_report.sources.web__2024____clean_.dropped.unknown_role:human": 3}


# ---------------------------------------------------------------- whole-file problems
def _write(path: Path, content: bytes | str | None) -> Path:
    if content is None:
        path.mkdir()
        (path / "part-0.jsonl").write_text("{}\n")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


WHOLE_FILE_CASES = {
    "empty": ("qa.jsonl", "", "gsm8k", r"is empty \(0 bytes\)"),
    "blank lines": ("qa.jsonl", "\n   \n\t\n", "gsm8k", "holds only blank lines"),
    "blank csv": ("qa.csv", "\n\n,,\n", "gsm8k", "holds only blank lines"),
    "json array in .jsonl": ("qa.jsonl", json.dumps([{"question": "q", "answer": "#### 1"}], indent=2), "gsm8k",
                             r"is one JSON array, not JSON lines \(one object per line\): name it \.json"),
    "broken json array": ("qa.json", '[{"question": "q", "answer": "#### 1"},\n {"question": }]', "gsm8k",
                          r"is not valid JSON \(Expecting value at line 2, column 15\)"),
    "csv without the columns": ("qa.csv", "problem,solution,source\nq,#### 1,web\n", "gsm8k",
                                r"has no column\(s\) 'question', 'answer' for format 'gsm8k'; its columns are 'problem', "
                                r"'solution', 'source'\. Map them .*`columns: \{question: \"problem\", answer: \"solution\"\}`"),
    "csv header only": ("qa.csv", "question,answer\n", "gsm8k", "has a header but no rows"),
    "corrupt parquet": ("qa.parquet", b"PAR1 this is not parquet", "gsm8k", "is not a readable Parquet file"),
    "utf-16": ("qa.jsonl", '{"question": "q", "answer": "#### 1"}\n'.encode("utf-16"), "gsm8k", "is UTF-16 text"),
    "directory": ("qa.jsonl", None, "gsm8k", r"is a directory, not a file; .* \(it holds part-0\.jsonl\)"),
    "unsupported type": ("qa.txt", "question: q\n", "gsm8k", "unsupported file type '.txt'"),
}


@pytest.mark.parametrize("case", WHOLE_FILE_CASES, ids=list(WHOLE_FILE_CASES))
def test_whole_file_problems_name_the_path_and_the_fix(tmp_path, case):
    filename, content, fmt, message = WHOLE_FILE_CASES[case]
    path = _write(tmp_path / filename, content)
    with pytest.raises(DataError) as err:
        ingest(IngestParams(sources=[SourceParams(name="qa", path=str(path), format=fmt)]))
    assert str(err.value).startswith(f"source 'qa': {path} ")
    assert re.search(message, str(err.value)), str(err.value)


def test_missing_file_and_parquet_without_columns(tmp_path):
    with pytest.raises(DataError, match=f"file not found: {re.escape(str(tmp_path / 'nope.csv'))}"):
        ingest(IngestParams(sources=[SourceParams(name="qa", path=str(tmp_path / "nope.csv"), format="gsm8k")]))
    path = tmp_path / "chat.parquet"
    pd.DataFrame({"conversation": [[{"role": "user", "content": "hi"}]]}).to_parquet(path)
    with pytest.raises(DataError, match=r"has no column\(s\) 'messages' .*`columns: \{messages: \"conversation\"\}`"):
        ingest(IngestParams(sources=[SourceParams(name="chat", path=str(path), format="messages")]))


# ---------------------------------------------------------------- the CLI
@pytest.mark.slow
def test_kedro_run_prints_a_data_error_without_traceback(project):
    (project / "data" / "01_raw" / "qa.jsonl").write_text(json.dumps([{"question": "q", "answer": "#### 1"}]))
    (project / "conf" / "local" / "parameters.yml").write_text(
        "ingest:\n  sources:\n    - {name: qa, path: data/01_raw/qa.jsonl, format: gsm8k}\n"
    )
    result = subprocess.run([KEDRO, "run", "--pipelines=ingest"], cwd=project, capture_output=True, text=True,
                            env=os.environ)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "Error: source 'qa': data/01_raw/qa.jsonl is one JSON array, not JSON lines" in result.stderr
    assert "Traceback" not in output


def test_run_command_turns_user_errors_into_messages_and_keeps_bugs(project):
    """The project's `run` (what `kedro run` calls): configuration errors are messages, other exceptions propagate."""
    from click.testing import CliRunner

    from tunix_pipeline.cli import run

    bootstrap_project(project)
    (project / "conf" / "local" / "parameters.yml").write_text("ingest:\n  eval_fraction: 2\n")
    result = CliRunner().invoke(run, ["--pipelines=ingest"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)  # click printed the message
    assert "Error: " in result.output and "eval_fraction" in result.output and "Traceback" not in result.output
    (project / "conf" / "local" / "parameters.yml").unlink()
    result = CliRunner().invoke(run, ["--pipelines=ingest", "--runner=NoSuchRunner"])
    assert isinstance(result.exception, AttributeError)  # not a user error: Kedro's CLI shows its traceback


def test_ctrl_c_outside_trainings_own_stop_is_one_line_naming_the_command(project, monkeypatch):
    """Ctrl-C in a node without a stop of its own (here: ingest; an evaluation or GRPO's screen alike) ends the run
    with one line naming the command that takes up what was saved, the shell's status for SIGINT, no traceback."""
    from click.testing import CliRunner

    from tunix_pipeline.cli import run
    from tunix_pipeline.pipelines.ingest import nodes

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    bootstrap_project(project)
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
    monkeypatch.setattr(nodes, "ingest", interrupted)  # the user's Ctrl-C, mid-node
    monkeypatch.setattr(sys, "argv", ["run", "--pipelines=ingest"])  # as typed (`kedro_command` reads it)
    result = CliRunner().invoke(run, ["--pipelines=ingest"])
    assert result.exit_code == 130 and "Traceback" not in result.output
    assert result.output.strip().endswith("is taken up by the same command: run --pipelines=ingest")
    assert result.output.count("Ctrl-C: stopped.") == 1
    # what the hooks close on an error is closed: the MLflow run ended KILLED, the output root's lock released
    # (and the tracking URI the run set is the caller's again: a later run, or its subprocesses, log where they should)
    assert mlflow.active_run() is None and not (project / "data" / ".run.lock").exists()
    assert os.environ.get("MLFLOW_TRACKING_URI") == tracking_uri
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["KILLED"]
