import pandas as pd

from tunix_pipeline.config import FormatParams
from tunix_pipeline.data.answers import extract_answer, well_formed
from tunix_pipeline.data.formatting import format_records, gemma_turns, render_prompt

# The chat template that google/gemma-2b-it ships in tokenizer_config.json.
GEMMA_IT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<reasoning>2+2=4</reasoning><answer>4</answer>"},
    {"role": "user", "content": " And 3+3? "},
]


def test_gemma_fallback_renders_what_gemmas_own_template_renders(tokenizer):
    with_template = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    with_template.chat_template = GEMMA_IT_TEMPLATE
    assert render_prompt(CONVERSATION, with_template, FormatParams()) == gemma_turns(CONVERSATION, "<bos>")
    assert gemma_turns(CONVERSATION[:1], "<bos>") == (
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_tokenizer_template_is_used_when_present(tokenizer):
    chatml = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    chatml.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert render_prompt(CONVERSATION[:1], chatml, FormatParams()) == "<|user|>What is 2+2?<|assistant|>"
    assert render_prompt(CONVERSATION[:1], chatml, FormatParams(chat_template="gemma")).startswith("<bos><start_of_turn>")


def test_records_become_prompt_and_completion(tokenizer):
    records = pd.DataFrame(
        [
            {"id": "1", "source": "s", "prompt": "2+2?", "messages": None, "reasoning": "2+2=4", "answer": "4"},
            {"id": "2", "source": "s", "prompt": None, "messages": CONVERSATION[:1], "reasoning": "", "answer": "4"},
        ]
    )
    out = format_records(records, tokenizer, FormatParams(system_prompt="Think step by step."))
    assert out.loc[0, "prompt"] == (
        "<bos><start_of_turn>user\nThink step by step.\n\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert out.loc[0, "completion"] == "<reasoning>2+2=4</reasoning><answer>4</answer><end_of_turn>"
    assert "What is 2+2?" in out.loc[1, "prompt"] and out.loc[1, "answer"] == "4"


def test_answer_extraction_and_format_compliance():
    assert extract_answer("<reasoning>x</reasoning><answer> 42 </answer>") == "42"
    assert extract_answer("no tags") is None
    assert well_formed("<reasoning>x</reasoning>\n<answer>42</answer>")
    assert not well_formed("<reasoning>x</reasoning>")
    assert not well_formed("<reasoning>x</reasoning><answer>42</answer> trailing")
    assert not well_formed("<reasoning></reasoning><answer>42</answer>")  # an empty part
    assert not well_formed("<reasoning>x</reasoning><answer>4</answer><answer>2</answer>")  # a tag twice


def test_open_ended_records_keep_their_mark_and_a_prompt_only_one_has_no_completion(tokenizer):
    records = pd.DataFrame(
        [
            {"id": "1", "source": "s", "prompt": "2+2?", "messages": None, "reasoning": "", "answer": "4",
             "open_ended": False},
            {"id": "2", "source": "w", "prompt": "A haiku.", "messages": None, "reasoning": "", "answer": "Rain falls.",
             "open_ended": True},
            {"id": "3", "source": "w", "prompt": "A limerick.", "messages": None, "reasoning": "", "answer": "",
             "open_ended": True},
        ]
    )
    out = format_records(records, tokenizer, FormatParams())
    assert out["open_ended"].tolist() == [False, True, True]
    assert out.loc[1, "completion"] == "<reasoning></reasoning><answer>Rain falls.</answer><end_of_turn>"
    assert out.loc[2, "completion"] == "" and out.loc[2, "prompt"].endswith("<start_of_turn>model\n")
    assert format_records(records.drop(columns="open_ended"), tokenizer, FormatParams())["open_ended"].eq(False).all()


def test_the_split_of_eval_records_reaches_the_formatted_rows(tmp_path, tokenizer):
    import json

    from tunix_pipeline.config import IngestParams, SourceParams
    from tunix_pipeline.data.ingest import ingest

    def qa(name, questions):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in questions))
        return str(path)

    _, evaluation, _ = ingest(IngestParams(sources=[
        SourceParams(name="train", path=qa("train.jsonl", [f"t{i}?" for i in range(10)]), format="gsm8k"),
        SourceParams(name="test", path=qa("test.jsonl", ["e1?", "e2?"]), format="gsm8k", eval_only=True),
    ], eval_fraction=0.2))
    out = format_records(evaluation, tokenizer, FormatParams())
    assert out.groupby("split")["source"].agg(set).to_dict() == {"dev": {"train"}, "test": {"test"}}
    assert out["split"].value_counts().to_dict() == {"dev": 2, "test": 2}
    # eval records written before the column existed were all carved from training: "dev"
    assert format_records(evaluation.drop(columns="split"), tokenizer, FormatParams())["split"].eq("dev").all()


def test_few_shot_prompts_show_solved_training_rows_in_the_same_chat_and_format_never_an_eval_row(tokenizer):
    """The shipped GSM8K files as the GSM8K recipe reads them (train carved into train and dev, test evaluation-only):
    each k-shot prompt is the zero-shot conversation with k solved training rows as earlier turns, their answers in
    the tagged format the models are scored on; the examples are drawn once, the same for every problem."""
    import pytest

    from tunix_pipeline.config import EvaluateParams, IngestParams, SourceParams
    from tunix_pipeline.data.answers import render
    from tunix_pipeline.data.formatting import few_shot_examples, format_few_shot
    from tunix_pipeline.data.ingest import ingest
    from tunix_pipeline.core.errors import UserError

    from .conftest import ROOT

    gsm8k = ROOT / "data" / "01_raw" / "gsm8k"
    train, evaluation, _ = ingest(IngestParams(sources=[
        SourceParams(name="gsm8k", path=str(gsm8k / "train.jsonl"), format="gsm8k", max_rows=200),
        SourceParams(name="gsm8k_test", path=str(gsm8k / "test.jsonl"), format="gsm8k", max_rows=20, eval_only=True),
    ], eval_fraction=0.1))
    params = FormatParams(system_prompt="Solve it. Answer in tags.")
    examples = few_shot_examples(train, 3, seed=0)
    assert len(examples) == 3 and set(examples["id"]) <= set(train["id"])
    assert not set(examples["id"]) & set(evaluation["id"])  # neither a dev row nor a test row
    assert examples["id"].tolist() == few_shot_examples(train, 3, seed=0)["id"].tolist()  # one draw, seeded

    zero_shot = format_records(evaluation, tokenizer, params)
    k_shot = format_few_shot(evaluation, examples, tokenizer, params)
    assert k_shot.drop(columns="prompt").equals(zero_shot.drop(columns="prompt"))  # the same problems, in order
    shots = "".join(f"<start_of_turn>user\n{q.strip()}<end_of_turn>\n<start_of_turn>model\n{render(r, a)}<end_of_turn>\n"
                    for q, r, a in zip(examples["prompt"], examples["reasoning"], examples["answer"]))
    shots = shots.replace("<start_of_turn>user\n", "<start_of_turn>user\nSolve it. Answer in tags.\n\n", 1)
    for record, prompt in zip(evaluation.to_dict(orient="records"), k_shot["prompt"]):
        question = f"<start_of_turn>user\n{record['prompt'].strip()}<end_of_turn>\n<start_of_turn>model\n"
        assert prompt == "<bos>" + shots + question
    assert set(k_shot["split"]) == {"dev", "test"}

    with pytest.raises(UserError, match=r"^evaluate.few_shot: 500 needs 500 solved training rows; the train split "
                                        r"has 180 \(lower evaluate.few_shot\)$"):
        few_shot_examples(train, 500, seed=0)
    with pytest.raises(ValueError, match="few_shot scores the base model: set compare_base_model: true"):
        EvaluateParams(few_shot=3, compare_base_model=False)
    assert EvaluateParams(few_shot=3, compare_base_model=False, few_shot_models="all").few_shot == 3
