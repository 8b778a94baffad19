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
