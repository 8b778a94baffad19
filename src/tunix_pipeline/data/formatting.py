"""Renders records as (prompt, completion) text pairs.

The prompt is the conversation up to the model's turn, rendered with the
tokenizer's own chat template when it has one, else with Gemma's turn format
(which is what Gemma's template renders, so both paths agree for Gemma).
The completion is `<reasoning>…</reasoning><answer>…</answer>` plus the
end-of-turn marker, kept apart from the prompt so the loss can skip it.
An open-ended row (`open_ended`: no answer to match) renders its reference the
same way; one without a reference has an empty completion (a prompt only).
Each row keeps its record's `split` (an eval row's says "dev" or "test").
"""

from __future__ import annotations

import pandas as pd

from tunix_pipeline.config import FormatParams
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.data.answers import GEMMA_END_OF_TURN, render
from tunix_pipeline.data.ingest import conversation

FORMATTED_COLUMNS = ["id", "source", "prompt", "completion", "answer", "open_ended", "split"]


def _conversation(record: dict, system_prompt: str | None) -> list[dict]:
    messages = conversation(record)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def gemma_turns(messages: list[dict], bos_token: str) -> str:
    """Gemma's turn format; a system message is folded into the first user turn."""
    messages = list(messages)
    if messages and messages[0]["role"] == "system":
        system = messages.pop(0)["content"]
        messages[0] = {**messages[0], "content": f"{system}\n\n{messages[0]['content']}"}
    text = bos_token
    for m in messages:
        role = "model" if m["role"] == "assistant" else m["role"]
        text += f"<start_of_turn>{role}\n{m['content'].strip()}{GEMMA_END_OF_TURN}\n"
    return text + "<start_of_turn>model\n"


def render_prompt(messages: list[dict], tokenizer, params: FormatParams) -> str:
    if params.chat_template == "auto" and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return gemma_turns(messages, tokenizer.bos_token or "")


def end_of_turn(tokenizer) -> str:
    """What closes the model's turn: Gemma's marker, else the tokenizer's EOS."""
    vocab = tokenizer.get_vocab()
    if GEMMA_END_OF_TURN in vocab:
        return GEMMA_END_OF_TURN
    return tokenizer.eos_token or ""


def is_open_ended(row: dict) -> bool:
    """A row with no answer to match (rows from before the column existed all have one)."""
    return bool(row.get("open_ended", False))


def split_of(row: dict) -> str:
    """A record's split: "train", "dev" or "test" (eval records from before the column existed were all "dev")."""
    split = row.get("split")
    return split if isinstance(split, str) and split else "dev"


def answer_rows(formatted: pd.DataFrame) -> pd.DataFrame:
    """The rows that have an answer to match."""
    return formatted[~formatted["open_ended"].astype(bool)] if "open_ended" in formatted else formatted


def format_records(records: pd.DataFrame, tokenizer, params: FormatParams) -> pd.DataFrame:
    closing = end_of_turn(tokenizer)
    pairs = "rejected_answer" in records.columns
    rows = []
    for record in records.to_dict(orient="records"):
        prompt = render_prompt(_conversation(record, params.system_prompt), tokenizer, params)
        completion = render(record["reasoning"], record["answer"]) + closing if record["answer"] else ""
        row = {"id": record["id"], "source": record["source"], "prompt": prompt, "completion": completion,
               "answer": record["answer"], "open_ended": is_open_ended(record), "split": split_of(record)}
        if pairs:  # a preference record: its rejected answer in the same format
            row["rejected"] = render(record["rejected_reasoning"], record["rejected_answer"]) + closing
        rows.append(row)
    return pd.DataFrame(rows, columns=FORMATTED_COLUMNS + (["rejected"] if pairs else []))


def few_shot_label(label: str, k: int) -> str:
    """The label a model's k-shot scores go by (`base_3shot`)."""
    return f"{label}_{k}shot"


def few_shot_examples(train_records: pd.DataFrame, k: int, seed: int) -> pd.DataFrame:
    """`k` solved rows of the training split, drawn once with `seed`: rows with an answer to match only."""
    solved = train_records[train_records["answer"].astype(str).str.len() > 0]
    if "open_ended" in solved:
        solved = solved[~solved["open_ended"].fillna(False).astype(bool)]
    if len(solved) < k:
        raise UserError(f"evaluate.few_shot: {k} needs {k} solved training rows; the train split has {len(solved)} "
                        "(lower evaluate.few_shot)")
    return solved.sample(n=k, random_state=seed)


def format_few_shot(records: pd.DataFrame, examples: pd.DataFrame, tokenizer, params: FormatParams) -> pd.DataFrame:
    """`records` formatted as `format_records` does, each prompt preceded by the `examples` as earlier turns of the
    same chat: their question from the user, their tagged answer from the model (the template closes the turn)."""
    shots = []
    for example in examples.to_dict(orient="records"):
        question = [m for m in conversation(example) if m["role"] != "system"]  # one system prompt: the eval's
        shots += [*question, {"role": "assistant", "content": render(example["reasoning"], example["answer"])}]
    formatted = format_records(records, tokenizer, params)
    prompts = []
    for record in records.to_dict(orient="records"):
        messages = _conversation(record, params.system_prompt)
        system = messages[:1] if messages[0]["role"] == "system" else []
        prompts.append(render_prompt(system + shots + messages[len(system):], tokenizer, params))
    return formatted.assign(prompt=prompts)
