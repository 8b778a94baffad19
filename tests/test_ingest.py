import json

import pandas as pd
import pytest

from tunix_pipeline.config import IngestParams, SourceParams
from tunix_pipeline.data.ingest import ingest, split_completion
from tunix_pipeline.data.readers import DataError

from .conftest import ROOT


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _params(*sources, **kwargs):
    return IngestParams(sources=list(sources), **{"eval_fraction": 0.0, **kwargs})


def test_committed_sources_in_three_formats():
    raw = ROOT / "data" / "01_raw"
    train, evaluation, report = ingest(
        IngestParams(
            sources=[
                SourceParams(name="gsm", path=str(raw / "arith_gsm8k.jsonl"), format="gsm8k"),
                SourceParams(name="alpaca", path=str(raw / "arith_alpaca.csv"), format="alpaca"),
                SourceParams(name="chat", path=str(raw / "arith_chat.jsonl"), format="messages"),
            ],
            eval_fraction=0.1,
        )
    )
    assert report["totals"] == {
        "rows_read": 400, "kept": 400, "dropped": 0, "duplicates": 0, "overlap_with_eval_only": 0,
        "calculator_annotations_removed": 0, "train_rows": 360, "eval_rows": 40, "dev_rows": 40, "test_rows": 0,
    }
    assert set(train["split"]) == {"train"} and set(evaluation["split"]) == {"dev"}
    assert set(train["source"]) == {"gsm", "alpaca", "chat"}
    assert not set(train["id"]) & set(evaluation["id"])
    chat = train[train["source"] == "chat"].iloc[0]
    assert chat["messages"][0]["role"] == "user" and chat["reasoning"] and chat["answer"].isdigit()
    alpaca = train[train["source"] == "alpaca"].iloc[0]
    assert alpaca["prompt"].startswith("Solve the word problem.\n\n") and "####" not in alpaca["reasoning"]


def test_split_is_seeded():
    raw = ROOT / "data" / "01_raw"
    src = SourceParams(name="gsm", path=str(raw / "arith_gsm8k.jsonl"), format="gsm8k")
    a = ingest(IngestParams(sources=[src], seed=1))
    b = ingest(IngestParams(sources=[src], seed=1))
    c = ingest(IngestParams(sources=[src], seed=2))
    assert a[1]["id"].tolist() == b[1]["id"].tolist()
    assert a[1]["id"].tolist() != c[1]["id"].tolist()


def test_bad_rows_are_skipped_and_reported_with_file_and_line(tmp_path):
    path = _jsonl(
        tmp_path / "qa.jsonl",
        [
            {"question": "1+1?", "answer": "1 + 1 = 2\n#### 2"},
            "{not json",
            {"question": "", "answer": "#### 3"},
            {"question": "2+2?"},
            {"question": 6, "answer": "#### 6"},
            {"question": "1+1?", "answer": "1 + 1 = 2\n#### 2"},  # duplicate
        ],
    )
    train, _, report = ingest(_params(SourceParams(name="qa", path=path, format="gsm8k")))
    stats = report["sources"]["qa"]
    assert (stats["rows_read"], stats["kept"], stats["duplicates"], stats["dropped_total"]) == (6, 1, 1, 4)
    assert stats["dropped"] == {"invalid_json": 1, "empty_field:question": 1, "missing_column:answer": 1, "wrong_type:question": 1}
    assert stats["dropped_rows"][0] == {
        "location": f"{path}:2", "reason": "invalid_json",
        "message": "invalid JSON (Expecting property name enclosed in double quotes at column 2)",
    }
    assert stats["dropped_rows"][3]["message"] == "'question' is a number, expected text"
    assert train.iloc[0][["prompt", "reasoning", "answer"]].tolist() == ["1+1?", "1 + 1 = 2", "2"]


def test_fail_mode_names_file_line_and_fix(tmp_path):
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "#### 1"}, {"question": "q2"}])
    with pytest.raises(DataError, match=r"qa\.jsonl:2: missing column 'answer'.*on_bad_row: skip"):
        ingest(_params(SourceParams(name="qa", path=path, format="gsm8k"), on_bad_row="fail"))


def test_csv_line_numbers_and_column_mapping(tmp_path):
    path = tmp_path / "legal.csv"
    path.write_text('q,a\n"What is a tort?","A civil wrong."\n"",x\n')
    train, _, report = ingest(
        _params(SourceParams(name="legal", path=str(path), format="prompt_response", columns={"prompt": "q", "response": "a"}))
    )
    assert train.iloc[0][["prompt", "reasoning", "answer"]].tolist() == ["What is a tort?", "", "A civil wrong."]
    assert report["sources"]["legal"]["dropped_rows"] == [
        {"location": f"{path}:3", "reason": "empty_field:q", "message": "'q' is empty"}
    ]


def test_parquet_messages_source(tmp_path):
    path = tmp_path / "chat.parquet"
    pd.DataFrame(
        {
            "conversation": [
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"},
                 {"role": "assistant", "content": "<reasoning>2*3=6</reasoning><answer>6</answer>"}],
                [{"role": "user", "content": "hi"}],
            ]
        }
    ).to_parquet(path)
    train, _, report = ingest(
        _params(SourceParams(name="chat", path=str(path), format="messages", columns={"messages": "conversation"}))
    )
    assert [m["role"] for m in train.iloc[0]["messages"]] == ["system", "user"]
    assert train.iloc[0][["reasoning", "answer"]].tolist() == ["2*3=6", "6"]
    assert report["sources"]["chat"]["dropped"] == {"no_assistant_turn": 1}


def test_hub_loader_reads_local_files_through_datasets(tmp_path):
    path = _jsonl(tmp_path / "hub.jsonl", [{"question": f"{i}+1?", "answer": f"#### {i + 1}"} for i in range(5)])
    source = SourceParams(name="hub", hf={"path": "json", "data_files": path, "split": "train"}, format="gsm8k")
    train, _, report = ingest(_params(source))
    assert len(train) == 5 and report["sources"]["hub"]["dropped_rows"] == []
    assert sorted(train["answer"].astype(int)) == [1, 2, 3, 4, 5]


def _hub_rows(n: int) -> list[dict]:
    return [{"question": f"{i}?", "answer": None if i == 7 else f"#### {i}"} for i in range(n)]  # row 7 is bad


def _hub_folder(folder, shards: int, rows: int, unreadable=(), suffix="parquet") -> str:
    """A dataset folder as the hub holds one: data/train-0000i-of-0000n.<suffix> of `rows` rows each (`_hub_rows`);
    the shards in `unreadable` are not Parquet, so opening one fails the read."""
    (folder / "data").mkdir(parents=True)
    table = _hub_rows(shards * rows)
    for i in range(shards):
        path = folder / "data" / f"train-{i:05d}-of-{shards:05d}.{suffix}"
        if i in unreadable:
            path.write_bytes(b"not parquet " * 100)
        elif suffix == "jsonl":
            _jsonl(path, table[i * rows:(i + 1) * rows])
        else:
            pd.DataFrame(table[i * rows:(i + 1) * rows]).to_parquet(path, row_group_size=10)
    return str(folder)


def test_hub_source_with_max_rows_streams_and_never_opens_the_shards_past_them(tmp_path):
    folder = _hub_folder(tmp_path / "hub", shards=4, rows=25, unreadable=(2, 3))
    source = SourceParams(name="hub", hf={"path": folder, "split": "train"}, format="gsm8k", max_rows=50)
    train, _, report = ingest(_params(source))  # shards 0 and 1 exactly: shard 2 is never opened
    stats = report["sources"]["hub"]
    assert (stats["rows_read"], stats["kept"], stats["dropped"]) == (50, 49, {"null_field:answer": 1})
    assert stats["dropped_rows"][0]["location"] == f"{folder}[train]:row 7"  # bad rows are handled as in files
    assert sorted(train["prompt"], key=lambda q: int(q[:-1])) == [f"{i}?" for i in range(50) if i != 7]
    assert stats["read"]["streamed"] and stats["read"]["rows"] == "the first 50 rows"
    # the digest is the rows read: the same rows from a file give the same digest, a row more another one
    same = _jsonl(tmp_path / "same.jsonl", _hub_rows(50))
    _, _, from_file = ingest(_params(SourceParams(name="file", path=same, format="gsm8k")))
    assert stats["read"]["sha256"] == from_file["sources"]["file"]["read"]["sha256"]

    with pytest.raises(DataError, match=r"source 'hub': datasets.load_dataset\(.*streaming=True\) failed at row 50: .*Parquet"):
        ingest(_params(source.model_copy(update={"max_rows": 51})))  # one row more opens shard 2
    with pytest.raises(DataError, match=r"hub\[train\]:row 7: 'answer' is null"):
        ingest(_params(source, on_bad_row="fail"))


def test_hub_source_with_a_shuffle_buffer_takes_seeded_rows_from_further_on(tmp_path):
    # JSON lines (a builder that learns its columns from the first row): a Parquet stream left early waits 5 s
    folder = _hub_folder(tmp_path / "hub", shards=4, rows=25, suffix="jsonl")
    source = SourceParams(name="hub", hf={"path": folder, "split": "train", "shuffle_buffer": 10}, format="gsm8k",
                          max_rows=20)
    first, _, report = ingest(_params(source, seed=0))
    again, _, _ = ingest(_params(source, seed=0))
    other, _, _ = ingest(_params(source, seed=1))
    assert report["sources"]["hub"]["rows_read"] == 20
    assert report["sources"]["hub"]["read"]["rows"].startswith("20 rows through a shuffle buffer of 10 (seed 0")
    assert sorted(first["id"]) == sorted(again["id"]) != sorted(other["id"])
    assert set(first["prompt"]) != {f"{i}?" for i in range(20)}  # not the first rows
    with pytest.raises(ValueError, match="hf.shuffle_buffer picks max_rows rows from a stream; set `max_rows`"):
        SourceParams(name="hub", hf={"path": folder, "shuffle_buffer": 10}, format="gsm8k")


def test_weights_repeat_or_subsample_train_rows(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"question": f"a{i}", "answer": f"#### {i}"} for i in range(10)])
    b = _jsonl(tmp_path / "b.jsonl", [{"question": f"b{i}", "answer": f"#### {i}"} for i in range(10)])
    train, _, report = ingest(
        _params(
            SourceParams(name="a", path=a, format="gsm8k", weight=2.0),
            SourceParams(name="b", path=b, format="gsm8k", weight=0.5),
        )
    )
    assert train["source"].value_counts().to_dict() == {"a": 20, "b": 5}
    assert report["sources"]["a"]["train_rows"] == 20


def test_missing_file_and_empty_result_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="file not found: .*nope.jsonl"):
        ingest(_params(SourceParams(name="x", path=str(tmp_path / "nope.jsonl"), format="gsm8k")))
    bad = _jsonl(tmp_path / "bad.jsonl", [{"text": "no question"}])
    good = _jsonl(tmp_path / "good.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(DataError, match=r"no usable rows: 'bad' \(.*bad.jsonl\): 1 rows read.*missing_column:question"):
        ingest(
            _params(
                SourceParams(name="good", path=good, format="gsm8k"),
                SourceParams(name="bad", path=bad, format="gsm8k"),
            )
        )


def test_split_completion_formats():
    assert split_completion("<reasoning>r</reasoning>\n<answer>a</answer>") == ("r", "a")
    assert split_completion("step\n#### 1,234") == ("step", "1234")
    assert split_completion("plain") == ("", "plain")


def test_source_needs_exactly_one_location():
    with pytest.raises(ValueError, match="exactly one of `path` or `hf`"):
        SourceParams(name="x", format="gsm8k")


def test_prose_with_markdown_headings_is_not_a_gsm8k_answer(tmp_path):
    # a legal Q&A row (seed 001's prompt/response shape): "#### Heading" followed by more lines is prose
    answer = "#### Issue\nWhether the contract is void.\n\n#### Conclusion\nIt is voidable, not void."
    path = _jsonl(tmp_path / "law.jsonl", [{"question": "Is a contract signed under duress void?", "answer": answer,
                                              "reasoning": "Step 1: duress vitiates consent."}])
    train, _, _ = ingest(_params(SourceParams(name="law", path=path, format="prompt_response",
                                              columns={"prompt": "question", "response": "answer"})))
    assert train.iloc[0][["reasoning", "answer"]].tolist() == ["Step 1: duress vitiates consent.", answer]
    # GSM8K's own marker still ends in the one-line final answer
    assert split_completion("a\n#### 1,234\n") == ("a", "1234")
    assert split_completion("#### Heading\nbody") == ("", "#### Heading\nbody")


def test_open_ended_rows_carry_a_reference_or_none_and_no_answer_to_match(tmp_path):
    path = _jsonl(
        tmp_path / "writing.jsonl",
        [
            {"task": "Write a haiku about rain.", "ref": "Soft rain on the roof"},
            {"task": "Summarise: the cat sat on the mat.", "ref": "<reasoning>Short.</reasoning><answer>A cat sat.</answer>"},
            {"task": "Write a limerick about a goat."},  # prompt only: a prompt for GRPO and evaluation
            {"task": "Tell a story.", "ref": None},
            {"task": "  ", "ref": "text"},
            {"task": "A poem?", "ref": "<reasoning>r</reasoning><answer> </answer>"},
        ],
    )
    source = SourceParams(name="writing", path=path, format="open", columns={"prompt": "task", "reference": "ref"})
    train, _, report = ingest(_params(source))
    by_prompt = train.set_index("prompt")
    assert by_prompt["open_ended"].tolist() == [True] * 4
    assert by_prompt.loc["Write a haiku about rain.", ["reasoning", "answer"]].tolist() == ["", "Soft rain on the roof"]
    assert by_prompt.loc["Summarise: the cat sat on the mat.", ["reasoning", "answer"]].tolist() == ["Short.", "A cat sat."]
    assert by_prompt.loc["Write a limerick about a goat.", "answer"] == by_prompt.loc["Tell a story.", "answer"] == ""
    dropped = report["sources"]["writing"]["dropped_rows"]
    assert [(d["location"], d["reason"]) for d in dropped] == [(f"{path}:5", "empty_field:task"),
                                                              (f"{path}:6", "empty_answer")]
    assert "leave it out for a prompt-only row" in dropped[1]["message"]
    with pytest.raises(DataError, match=r"writing\.jsonl:5: 'task' is empty"):
        ingest(_params(source, on_bad_row="fail"))


def test_rows_of_the_answer_formats_are_not_open_ended(tmp_path):
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    train, _, _ = ingest(_params(SourceParams(name="qa", path=path, format="gsm8k")))
    assert train["open_ended"].tolist() == [False]


def _qa(path, questions):
    return _jsonl(path, [{"question": q, "answer": f"#### {i}"} for i, q in enumerate(questions)])


def test_eval_only_rows_are_test_rows_and_their_questions_are_left_out_of_training(tmp_path, caplog):
    train_questions = [f"Train question {i}?" for i in range(20)] + ["What  is 2+2?", "Name the capital of France."]
    train_path = _qa(tmp_path / "train.jsonl", train_questions)
    test_path = _qa(tmp_path / "test.jsonl", ["what is 2+2? ", "NAME the capital\nof France.", "Held out 3?"])
    # listed after the training source: still read first, so its questions leave training
    train, evaluation, report = ingest(_params(
        SourceParams(name="gsm", path=train_path, format="gsm8k"),
        SourceParams(name="gsm_test", path=test_path, format="gsm8k", eval_only=True),
        eval_fraction=0.25,
    ))
    test = evaluation[evaluation["split"] == "test"]
    assert sorted(test["prompt"]) == sorted(["what is 2+2?", "NAME the capital\nof France.", "Held out 3?"])
    assert set(test["source"]) == {"gsm_test"}
    dev = evaluation[evaluation["split"] == "dev"]
    assert len(dev) == 5 and set(dev["source"]) == {"gsm"}  # 25% of the 20 rows left
    assert set(train["split"]) == {"train"} and len(train) == 15
    assert not {"What  is 2+2?", "Name the capital of France."} & (set(train["prompt"]) | set(dev["prompt"]))

    gsm, gsm_test = report["sources"]["gsm"], report["sources"]["gsm_test"]
    assert list(report["sources"]) == ["gsm", "gsm_test"]  # as configured
    assert (gsm["eval_only"], gsm["overlap_with_eval_only"], gsm["kept"], gsm["train_rows"], gsm["eval_rows"]) == (
        False, 2, 20, 15, 5)
    assert (gsm_test["eval_only"], gsm_test["kept"], gsm_test["train_rows"], gsm_test["eval_rows"]) == (True, 3, 0, 3)
    assert "overlap_with_eval_only" not in gsm_test
    totals = report["totals"]
    assert (totals["train_rows"], totals["eval_rows"], totals["dev_rows"], totals["test_rows"]) == (15, 8, 5, 3)
    assert totals["overlap_with_eval_only"] == 2 and totals["duplicates"] == 0
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "left out of training 2 rows whose question is an eval-only source's: {'gsm': 2}"]


def test_eval_only_rows_take_no_eval_fraction_and_no_weight(tmp_path):
    train_path = _qa(tmp_path / "train.jsonl", [f"t{i}?" for i in range(10)])
    test_path = _qa(tmp_path / "test.jsonl", [f"e{i}?" for i in range(10)])
    train, evaluation, report = ingest(_params(
        SourceParams(name="test", path=test_path, format="gsm8k", eval_only=True),
        SourceParams(name="train", path=train_path, format="gsm8k", weight=2.0),
        eval_fraction=0.0,
    ))
    assert evaluation["split"].tolist() == ["test"] * 10 and len(train) == 20
    assert report["totals"]["overlap_with_eval_only"] == 0 and report["totals"]["dev_rows"] == 0


def test_eval_only_config_errors(tmp_path):
    with pytest.raises(ValueError, match="source 'test': `weight` scales a source's training rows.*`eval_only`"):
        SourceParams(name="test", path="test.jsonl", format="gsm8k", eval_only=True, weight=2.0)
    with pytest.raises(ValueError, match=r"every source \(a, b\) sets `eval_only: true`; at least one must be a tr"):
        _params(SourceParams(name="a", path="a.jsonl", format="gsm8k", eval_only=True),
                SourceParams(name="b", path="b.jsonl", format="gsm8k", eval_only=True))


def test_a_training_source_whose_every_question_is_held_out_says_so(tmp_path):
    path = _qa(tmp_path / "qa.jsonl", ["q?"])
    with pytest.raises(DataError, match=r"'train' \(.*\): 1 rows read, dropped none, 1 asking an eval-only source's"):
        ingest(_params(SourceParams(name="test", path=path, format="gsm8k", eval_only=True),
                       SourceParams(name="train", path=path, format="gsm8k")))


def test_gsm8k_test_split_ships_beside_the_train_split():
    gsm8k = ROOT / "data" / "01_raw" / "gsm8k"
    _, evaluation, report = ingest(_params(
        SourceParams(name="gsm8k", path=str(gsm8k / "train.jsonl"), format="gsm8k", max_rows=50),
        SourceParams(name="gsm8k_test", path=str(gsm8k / "test.jsonl"), format="gsm8k", eval_only=True, max_rows=50),
    ))
    assert report["totals"]["test_rows"] == 50 and set(evaluation["split"]) == {"test"}
