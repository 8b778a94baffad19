import numpy as np
import pandas as pd
import pytest

from tunix_pipeline.config import TokenizeParams
from tunix_pipeline.data.tokenization import stack, tokenize_split


def _formatted(prompts, completions):
    return pd.DataFrame(
        {"id": [str(i) for i in range(len(prompts))], "prompt": prompts, "completion": completions, "answer": "1"}
    )


def test_fixed_length_and_completion_only_mask(tokenizer):
    prompt = "<bos><start_of_turn>user\nAda has 3 apples.<end_of_turn>\n<start_of_turn>model\n"
    completion = "<reasoning>3 + 1 = 4.</reasoning><answer>4</answer><end_of_turn>"
    rows, stats = tokenize_split(_formatted([prompt], [completion]), tokenizer, TokenizeParams(max_length=64))
    tokens, loss, segments, positions = (
        stack(rows, c)[0] for c in ("input_tokens", "loss_mask", "segment_ids", "positions")
    )
    assert tokens.shape == loss.shape == segments.shape == (64,)
    attention = segments > 0
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    n_real = int(attention.sum())
    assert tokenizer.decode(tokens[loss == 1]) == completion
    assert loss[:n_prompt].sum() == 0 and loss[n_real:].sum() == 0
    assert (tokens[n_real:] == tokenizer.pad_token_id).all()
    assert positions[:n_real].tolist() == list(range(n_real)) and set(segments[:n_real]) == {1}
    assert stats["padding_efficiency"] == pytest.approx(n_real / 64)
    assert stats["rows_out"] == 1 and stats["truncated"] == 0


def test_overlong_rows_are_truncated_or_dropped_and_counted(tokenizer):
    short = ("<bos>q", "a")
    long = ("<bos>question", "a very long completion " * 20)
    prompt_too_long = ("<bos>" + "word " * 100, "a")
    data = _formatted(*zip(short, long, prompt_too_long))
    rows, stats = tokenize_split(data, tokenizer, TokenizeParams(max_length=32, overflow="truncate"))
    assert (stats["rows_out"], stats["truncated"], stats["dropped_prompt_too_long"]) == (2, 1, 1)
    assert (stack(rows, "segment_ids")[1] > 0).sum() == 32
    rows, stats = tokenize_split(data, tokenizer, TokenizeParams(max_length=32, overflow="drop"))
    assert (stats["rows_out"], stats["dropped_overlong"], stats["dropped_prompt_too_long"]) == (1, 1, 1)
    assert rows["id"].tolist() == ["0"]
    assert sum(stats["length_histogram"]["counts"]) == 3


def test_prompt_only_rows_are_skipped_and_counted(tokenizer):
    data = _formatted(["<bos>q0", "<bos>write a poem", "<bos>q2"], ["a", "", "b"])
    rows, stats = tokenize_split(data, tokenizer, TokenizeParams(max_length=16))
    assert rows["id"].tolist() == ["0", "2"]
    assert (stats["rows_in"], stats["skipped_prompt_only"], stats["examples_out"]) == (3, 1, 2)
    rows, stats = tokenize_split(data.iloc[[1]], tokenizer, TokenizeParams(max_length=16))
    assert rows.empty and (stats["rows_in"], stats["skipped_prompt_only"], stats["rows_out"]) == (1, 1, 0)


def test_the_tokenize_node_says_what_to_do_when_every_training_row_is_a_prompt_only(tiny_model_dir):
    from tunix_pipeline.config import SftParams
    from tunix_pipeline.data.readers import DataError
    from tunix_pipeline.pipelines.tokenize.nodes import tokenize

    prompts = _formatted(["<bos>write a poem", "<bos>write a song"], ["", ""])
    sft = SftParams(max_steps=10, per_device_batch_size=1, learning_rate=1e-4, checkpoint_every=5)
    with pytest.raises(DataError, match=r"all 2 training rows are open-ended prompts without a reference.*max_steps: 0"):
        tokenize(prompts, prompts, {"path": str(tiny_model_dir)}, TokenizeParams(max_length=16), sft)
    # no SFT this session (another run's checkpoint passes on): the prompts go on to GRPO
    passing = sft.model_copy(update={"max_steps": 0, "init_from": "runs/sft"})
    train, _, report = tokenize(prompts, prompts, {"path": str(tiny_model_dir)}, TokenizeParams(max_length=16), passing)
    assert train.empty and report["train"]["skipped_prompt_only"] == 2


def test_rows_survive_a_parquet_round_trip(tokenizer, tmp_path):
    rows, _ = tokenize_split(_formatted(["<bos>q"], ["a"]), tokenizer, TokenizeParams(max_length=16))
    rows.to_parquet(tmp_path / "t.parquet")
    back = pd.read_parquet(tmp_path / "t.parquet")
    np.testing.assert_array_equal(stack(back, "input_tokens"), stack(rows, "input_tokens"))


def test_packing_fills_rows_and_keeps_examples_apart(tokenizer):
    prompts = [f"<bos>question {i}" for i in range(12)]
    completions = [f"answer {i} " * (1 + i % 3) for i in range(12)]
    data = _formatted(prompts, completions)
    plain, plain_stats = tokenize_split(data, tokenizer, TokenizeParams(max_length=64))
    packed, stats = tokenize_split(data, tokenizer, TokenizeParams(max_length=64, pack=True))
    assert stats["examples_out"] == plain_stats["rows_out"] == 12 and stats["rows_out"] < 12
    assert stats["padding_efficiency"] > 2 * stats["padding_efficiency_unpacked"]
    # the unpacked run's estimate of packing is what packing then writes (the plan's expected gain)
    assert plain_stats["padding_efficiency_packed"] == stats["padding_efficiency"] == stats["padding_efficiency_packed"]
    real = int((stack(plain, "segment_ids") > 0).sum())
    assert stats["padding_efficiency"] == pytest.approx(real / (stats["rows_out"] * 64))
    segments, positions = stack(packed, "segment_ids"), stack(packed, "positions")
    loss, tokens = stack(packed, "loss_mask"), stack(packed, "input_tokens")
    # every example appears once, whole, with its own positions from 0
    assert sum(len(ids.split(",")) for ids in packed["id"]) == 12
    assert int((segments > 0).sum()) == int((stack(plain, "segment_ids") > 0).sum())
    assert int(loss.sum()) == int(stack(plain, "loss_mask").sum())
    for row in range(len(packed)):
        for seg in set(segments[row]) - {0}:
            where = segments[row] == seg
            assert positions[row][where].tolist() == list(range(where.sum()))
            assert tokens[row][where][0] == tokenizer.bos_token_id


def test_the_packing_estimate_of_many_examples_samples_them_within_a_percent():
    from tunix_pipeline.data.tokenization import _pack, packed_efficiency

    sizes = np.random.default_rng(0).integers(20, 700, 6000).tolist()  # more than the 4,096 it packs
    exact = sum(sizes) / (len(_pack(sizes, 1024)) * 1024)
    estimate = packed_efficiency(sizes, 1024)
    assert estimate != exact and estimate == pytest.approx(exact, rel=0.01)
