import numpy as np
import pandas as pd
import pytest

from tunix_pipeline.config import TokenizeParams
from tunix_pipeline.tokenization import stack, tokenize_split


def _formatted(prompts, completions):
    return pd.DataFrame(
        {"id": [str(i) for i in range(len(prompts))], "prompt": prompts, "completion": completions, "answer": "1"}
    )


def test_fixed_length_and_completion_only_mask(tokenizer):
    prompt = "<bos><start_of_turn>user\nAda has 3 apples.<end_of_turn>\n<start_of_turn>model\n"
    completion = "<reasoning>3 + 1 = 4.</reasoning><answer>4</answer><end_of_turn>"
    rows, stats = tokenize_split(_formatted([prompt], [completion]), tokenizer, TokenizeParams(max_length=64))
    tokens, loss, attention = (stack(rows, c)[0] for c in ("input_tokens", "loss_mask", "attention_mask"))
    assert tokens.shape == loss.shape == attention.shape == (64,)
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    n_real = int(attention.sum())
    assert tokenizer.decode(tokens[loss == 1]) == completion
    assert loss[:n_prompt].sum() == 0 and loss[n_real:].sum() == 0
    assert (tokens[n_real:] == tokenizer.pad_token_id).all()
    assert stats["padding_efficiency"] == pytest.approx(n_real / 64)
    assert stats["rows_out"] == 1 and stats["truncated"] == 0


def test_overlong_rows_are_truncated_or_dropped_and_counted(tokenizer):
    short = ("<bos>q", "a")
    long = ("<bos>question", "a very long completion " * 20)
    prompt_too_long = ("<bos>" + "word " * 100, "a")
    data = _formatted(*zip(short, long, prompt_too_long))
    rows, stats = tokenize_split(data, tokenizer, TokenizeParams(max_length=32, overflow="truncate"))
    assert (stats["rows_out"], stats["truncated"], stats["dropped_prompt_too_long"]) == (2, 1, 1)
    assert stack(rows, "attention_mask")[1].sum() == 32
    rows, stats = tokenize_split(data, tokenizer, TokenizeParams(max_length=32, overflow="drop"))
    assert (stats["rows_out"], stats["dropped_overlong"], stats["dropped_prompt_too_long"]) == (1, 1, 1)
    assert rows["id"].tolist() == ["0"]
    assert sum(stats["length_histogram"]["counts"]) == 3


def test_rows_survive_a_parquet_round_trip(tokenizer, tmp_path):
    rows, _ = tokenize_split(_formatted(["<bos>q"], ["a"]), tokenizer, TokenizeParams(max_length=16))
    rows.to_parquet(tmp_path / "t.parquet")
    back = pd.read_parquet(tmp_path / "t.parquet")
    np.testing.assert_array_equal(stack(back, "input_tokens"), stack(rows, "input_tokens"))
