"""Sources in the shapes users have: the shipped GSM8K with its calculator annotations, one JSON array of records,
nested fields, a field built from several columns (SVAMP's body + question), numeric answer columns, ShareGPT's
conversations, TRL's conversational prompt/completion and preference rows, HH-RLHF's transcripts, and gzipped files."""

import gzip
import json

import pandas as pd
import pytest

from tunix_pipeline.config import IngestParams, SourceParams
from tunix_pipeline.data.answers import answers_match
from tunix_pipeline.data.ingest import ingest
from tunix_pipeline.data.readers import DataError

from .conftest import ROOT

GSM8K = ROOT / "data" / "01_raw" / "gsm8k"


def _ingest(**source):
    return ingest(IngestParams(sources=[SourceParams(name="src", **source)], eval_fraction=0.0))


@pytest.mark.parametrize("strip", [None, False])
def test_the_shipped_gsm8k_train_split_is_read_whole_and_its_calculator_annotations_are_counted(strip):
    train, _, report = _ingest(path=str(GSM8K / "train.jsonl"), format="gsm8k", strip_calculator_annotations=strip)
    source = report["sources"]["src"]
    assert source["rows_read"] == source["kept"] == len(train) == 7473 and source["dropped_total"] == 0
    raw = [json.loads(line)["answer"] for line in (GSM8K / "train.jsonl").read_text().splitlines()]
    annotated = sum("<<" in answer for answer in raw)
    if strip is None:  # on by default for the gsm8k format
        assert source["calculator_annotations"] == {"rows": annotated, "removed": sum(a.count("<<") for a in raw)}
        assert report["totals"]["calculator_annotations_removed"] == source["calculator_annotations"]["removed"]
        assert not train["reasoning"].str.contains("<<|>>").any()
        natalia = train[train["prompt"].str.startswith("Natalia sold clips")].iloc[0]
        assert natalia["reasoning"].startswith("Natalia sold 48/2 = 24 clips in May.") and natalia["answer"] == "72"
    else:
        assert "calculator_annotations" not in source and report["totals"]["calculator_annotations_removed"] == 0
        assert train["reasoning"].str.contains("<<").sum() == annotated > 7000


def test_other_formats_keep_annotations_unless_asked(tmp_path):
    path = tmp_path / "pr.jsonl"
    path.write_text(json.dumps({"prompt": "48/2?", "response": "48/2 = <<48/2=24>>24\n#### 24"}) + "\n")
    kept, _, _ = _ingest(path=str(path), format="prompt_response")
    stripped, _, report = _ingest(path=str(path), format="prompt_response", strip_calculator_annotations=True)
    assert kept.iloc[0]["reasoning"] == "48/2 = <<48/2=24>>24" and stripped.iloc[0]["reasoning"] == "48/2 = 24"
    assert report["sources"]["src"]["calculator_annotations"] == {"rows": 1, "removed": 1}


SVAMP = [  # SVAMP's shape: the question is Body + Question, the answer a float column
    {"ID": "chal-1", "Body": "Jack had 8 pens and Mary had 5 pens.", "Question": "How many pens did they have?",
     "Equation": "( 8.0 + 5.0 )", "Answer": 13.0},
    {"ID": "chal-2", "Body": "A cake is cut in 4.", "Question": "What share is one piece?", "Equation": "1/4",
     "Answer": 0.25},
]
SVAMP_COLUMNS = {"question": "{Body} {Question}", "answer": "Answer"}


@pytest.mark.parametrize("suffix", [".json", ".csv", ".parquet"])
def test_a_question_built_from_two_columns_and_a_numeric_answer_column(tmp_path, suffix):
    path = tmp_path / f"svamp{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(SVAMP, indent=2))  # one JSON array of records, as SVAMP ships
    elif suffix == ".csv":
        pd.DataFrame(SVAMP).to_csv(path, index=False)  # the float column is written as 13.0
    else:
        pd.DataFrame(SVAMP).to_parquet(path)
    train, _, _ = _ingest(path=str(path), format="gsm8k", columns=SVAMP_COLUMNS)
    by_id = train.set_index("prompt")
    jack = by_id.loc["Jack had 8 pens and Mary had 5 pens. How many pens did they have?"]
    assert jack["answer"] == "13" and jack["reasoning"] == ""
    assert by_id.loc["A cake is cut in 4. What share is one piece?"]["answer"] == "0.25"
    assert answers_match("13", jack["answer"], 1e-6)


def test_nested_fields_in_json_lines_and_through_datasets(tmp_path):
    rows = [{"problem": {"text": f"{i} + 1?", "meta": {"level": 1}}, "solution": {"final": i + 1.0, "steps": f"{i} + 1"}}
            for i in range(4)]
    path = tmp_path / "nested.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns = {"prompt": "problem.text", "response": "solution.final", "reasoning": "solution.steps"}
    local, _, _ = _ingest(path=str(path), format="prompt_response", columns=columns)
    hub, _, _ = _ingest(hf={"path": "json", "data_files": str(path), "split": "train"}, format="prompt_response",
                        columns=columns)
    for train in (local, hub):
        assert sorted(train[["prompt", "reasoning", "answer"]].values.tolist()) == [
            [f"{i} + 1?", f"{i} + 1", str(i + 1)] for i in range(4)]


def test_a_column_name_with_a_dot_is_read_as_that_column(tmp_path):
    path = tmp_path / "dotted.csv"
    path.write_text("q.text,a\nWhat is 2+2?,4\n")
    train, _, _ = _ingest(path=str(path), format="prompt_response", columns={"prompt": "q.text", "response": "a"})
    assert train.iloc[0][["prompt", "answer"]].tolist() == ["What is 2+2?", "4"]


def test_a_missing_column_in_a_template_is_named_with_its_source(tmp_path):
    path = tmp_path / "svamp.csv"
    pd.DataFrame(SVAMP).to_csv(path, index=False)
    with pytest.raises(DataError, match=r"source 'src': .*svamp.csv has no column\(s\) 'Problem' .*its columns are "
                                        r"'ID', 'Body', 'Question', 'Equation', 'Answer'\. Fix `columns:` .*"
                                        r"question: '\{Body\} \{Problem\}'"):
        _ingest(path=str(path), format="gsm8k", columns={"question": "{Body} {Problem}", "answer": "Answer"})


def test_a_missing_nested_field_drops_the_row_with_its_name(tmp_path):
    path = tmp_path / "nested.jsonl"
    path.write_text(json.dumps({"problem": {"text": "1+1?"}, "answer": "#### 2"}) + "\n"
                    + json.dumps({"problem": {"body": "2+2?"}, "answer": "#### 4"}) + "\n")
    train, _, report = _ingest(path=str(path), format="gsm8k", columns={"question": "problem.text"})
    assert len(train) == 1
    assert report["sources"]["src"]["dropped_rows"] == [
        {"location": f"{path}:2", "reason": "missing_column:problem.text", "message": "missing column 'problem.text'"}]
    # no row has the field: the error names the source, the field and the first row without it
    with pytest.raises(DataError, match=r"'src' \(.*nested.jsonl\): 2 rows read, .*missing_column:problem.title.*"
                                        r"first: .*nested.jsonl:1: missing column 'problem.title'"):
        _ingest(path=str(path), format="gsm8k", columns={"question": "problem.title"})


def test_a_template_that_does_not_close_is_a_config_error():
    with pytest.raises(ValueError, match=r"columns.question = '\{Body \{Question\}' is not a column"):
        SourceParams(name="s", path="x.csv", format="gsm8k", columns={"question": "{Body {Question}"})


def test_sharegpt_conversations_are_read_as_chat_turns(tmp_path):
    """ShareGPT's shape (`conversations` of `{from: human | gpt | system, value}`), the most common chat dump: its
    roles read as system/user/assistant; without the `columns:` mapping every row is dropped with its columns named."""
    rows = [{"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"},
                                          {"from": "gpt", "value": "<reasoning>2+2=4</reasoning><answer>4</answer>"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "3+3?"}, {"from": "bot", "value": "6"}]}]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    train, _, report = _ingest(path=str(path), format="messages", columns={"messages": "conversations"})
    assert train.iloc[0]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert (train.iloc[0]["reasoning"], train.iloc[0]["answer"]) == ("2+2=4", "4") and len(train) == 1
    assert report["sources"]["src"]["dropped"] == {"unknown_role:bot": 1}  # only ShareGPT's own names are mapped
    with pytest.raises(DataError, match=r"missing column 'messages' \(the row has 'id', 'conversations'; where one of "
                                        r"them holds it, name that column in this source's `columns:`\)"):
        _ingest(path=str(path), format="messages")


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


USER_2_PLUS_2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def test_trls_conversational_prompt_completion_rows_are_read_as_chat_turns(tmp_path):
    """TRL's conversational prompt-completion shape (`prompt`: the turns up to the user's, `completion`: one assistant
    turn) reads as the same record as the chat it splits; a prompt ending with the assistant's turn, or a completion
    that holds other turns, drops its row with the reason."""
    answer = "<reasoning>2+2=4</reasoning><answer>4</answer>"
    rows = [{"prompt": USER_2_PLUS_2, "completion": [{"role": "assistant", "content": answer}]},
            {"prompt": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}],
             "completion": [{"role": "assistant", "content": "6"}]},
            {"prompt": [{"role": "user", "content": "4+4?"}],
             "completion": [{"role": "user", "content": "hm"}, {"role": "assistant", "content": "8"}]}]
    columns = {"response": "completion"}
    train, _, report = _ingest(path=_jsonl(tmp_path / "pc.jsonl", rows), format="prompt_response", columns=columns)
    chat, _, _ = _ingest(path=_jsonl(tmp_path / "chat.jsonl", [{"messages": [*USER_2_PLUS_2,
                                                                           {"role": "assistant", "content": answer}]}]),
                         format="messages")
    assert len(train) == 1 and train.iloc[0]["prompt"] is None
    assert train.drop(columns=["id", "source"]).equals(chat.drop(columns=["id", "source"]))
    assert report["sources"]["src"]["dropped"] == {"prompt_ends_with:assistant": 1, "completion_turns:completion": 1}


def test_trls_conversational_preference_rows_and_prompt_only_rows(tmp_path):
    """TRL's preference shape with an explicit prompt (`prompt` turns, `chosen` and `rejected` one assistant turn
    each) reads as the pair it holds, as the same pair does as whole chats (the UltraFeedback-binarized shape); a
    conversational prompt-only row is an `open` prompt, for GRPO and evaluation."""
    chosen, rejected = "<reasoning>2+2=4</reasoning><answer>4</answer>", "<reasoning>2+2=5</reasoning><answer>5</answer>"
    explicit = [{"prompt": USER_2_PLUS_2, "chosen": [{"role": "assistant", "content": chosen}],
                 "rejected": [{"role": "assistant", "content": rejected}]}]
    whole = [{"chosen": [*USER_2_PLUS_2, {"role": "assistant", "content": chosen}],
              "rejected": [*USER_2_PLUS_2, {"role": "assistant", "content": rejected}]}]
    pairs, _, _ = _ingest(path=_jsonl(tmp_path / "explicit.jsonl", explicit), format="preference")
    same, _, _ = _ingest(path=_jsonl(tmp_path / "whole.jsonl", whole), format="preference")
    assert pairs.drop(columns=["source"]).equals(same.drop(columns=["source"]))
    assert pairs.iloc[0]["messages"] == USER_2_PLUS_2
    assert (pairs.iloc[0]["answer"], pairs.iloc[0]["rejected_answer"]) == ("4", "5")
    prompts, _, _ = _ingest(path=_jsonl(tmp_path / "open.jsonl", [{"prompt": USER_2_PLUS_2}]), format="open")
    assert prompts.iloc[0]["messages"] == USER_2_PLUS_2 and prompts.iloc[0]["open_ended"]


def test_anthropic_hh_rlhf_transcripts_are_read_as_chat_pairs(tmp_path):
    """Anthropic's HH-RLHF shape: `chosen` and `rejected` transcripts (`\n\nHuman: ...\n\nAssistant: ...`) that share
    their turns but the last; a pair whose earlier turns differ is dropped with the reason."""
    turns = "\n\nHuman: What is 2+2?\n\nAssistant: Do you mean in base 10?\n\nHuman: Yes."
    rows = [{"chosen": turns + "\n\nAssistant: It is 4.", "rejected": turns + "\n\nAssistant: It is 5."},
            {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hey\n\nAssistant: Go away."}]
    pairs, _, report = _ingest(path=_jsonl(tmp_path / "hh.jsonl", rows), format="preference")
    assert len(pairs) == 1 and pairs.iloc[0]["prompt"] is None
    assert pairs.iloc[0]["messages"] == [{"role": "user", "content": "What is 2+2?"},
                                         {"role": "assistant", "content": "Do you mean in base 10?"},
                                         {"role": "user", "content": "Yes."}]
    assert (pairs.iloc[0]["answer"], pairs.iloc[0]["rejected_answer"]) == ("It is 4.", "It is 5.")
    assert report["sources"]["src"]["dropped"] == {"prompt_mismatch": 1}


@pytest.mark.parametrize("name", ["rows.jsonl.gz", "rows.json.gz", "rows.csv.gz"])
def test_gzipped_files_are_read_as_their_plain_copies(tmp_path, name):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(5)]
    plain = tmp_path / name.removesuffix(".gz")
    if plain.suffix == ".csv":
        pd.DataFrame(rows).to_csv(plain, index=False)
    else:
        plain.write_text("\n".join(map(json.dumps, rows)) if plain.suffix == ".jsonl" else json.dumps(rows))
    (tmp_path / name).write_bytes(gzip.compress(plain.read_bytes()))
    unzipped, _, _ = _ingest(path=str(plain), format="gsm8k")
    zipped, _, report = _ingest(path=str(tmp_path / name), format="gsm8k")
    assert zipped.equals(unzipped) and len(zipped) == 5
    assert report["sources"]["src"]["read"]["location"] == str(tmp_path / name)


def test_a_damaged_gzip_file_stops_in_one_line_naming_it(tmp_path):
    data = "\n".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(2000)).encode()
    cut, plain = tmp_path / "cut.jsonl.gz", tmp_path / "plain.jsonl.gz"
    cut.write_bytes(gzip.compress(data)[:2000])
    plain.write_bytes(data)  # named .gz, never compressed
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz is a damaged or cut-short gzip file"):
        _ingest(path=str(cut), format="gsm8k")
    with pytest.raises(DataError, match=r"plain\.jsonl\.gz cannot be read as \.jsonl compressed with gzip"):
        _ingest(path=str(plain), format="gsm8k")
    with pytest.raises(DataError, match=r"unsupported file type '\.parquet\.gz'"):
        (tmp_path / "x.parquet.gz").write_bytes(b"x")
        _ingest(path=str(tmp_path / "x.parquet.gz"), format="gsm8k")
