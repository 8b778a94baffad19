import logging

import pandas as pd

from tunix_pipeline.config import SftParams, TokenizeParams
from tunix_pipeline.data.readers import DataError
from tunix_pipeline.data.tokenization import tokenize_split
from tunix_pipeline.models import load_tokenizer

log = logging.getLogger(__name__)


def tokenize(
    train_formatted: pd.DataFrame, eval_formatted: pd.DataFrame, base_model: dict, params: TokenizeParams,
    sft: SftParams,
) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    tokenizer = load_tokenizer(base_model["path"])
    train_tokens, train_stats = tokenize_split(train_formatted, tokenizer, params)
    eval_tokens, eval_stats = tokenize_split(eval_formatted, tokenizer, params)
    for split, stats in (("train", train_stats), ("eval", eval_stats)):
        if stats["skipped_prompt_only"]:
            log.info("tokenize: %d of the %d %s rows are open-ended prompts without a reference: no SFT target "
                     "(they stay prompts for GRPO and evaluation)", stats["skipped_prompt_only"], stats["rows_in"], split)
    # `sft.max_steps: 0` trains nothing this session (e.g. GRPO on prompts from another run's SFT checkpoint)
    if not len(train_tokens) and sft.max_steps != 0:
        raise DataError(_no_training_rows(train_stats, params))
    return train_tokens, eval_tokens, {"train": train_stats, "eval": eval_stats}


def _no_training_rows(stats: dict, params: TokenizeParams) -> str:
    if stats["rows_in"] and stats["skipped_prompt_only"] == stats["rows_in"]:
        return (f"tokenize: SFT has nothing to learn from: all {stats['rows_in']} training rows are open-ended prompts "
                "without a reference. Give some rows a `reference` (or add a source with answers), or skip SFT with "
                "`sft.max_steps: 0` and `sft.init_from: <an SFT checkpoint>` to use the prompts for GRPO")
    return (
        f"tokenize: no training rows left at max_length={params.max_length} "
        f"(dropped: {stats['dropped_overlong']} overlong, "
        f"{stats['dropped_prompt_too_long']} with prompts that fill the length, "
        f"{stats['skipped_prompt_only']} prompt-only); "
        "raise `tokenize.max_length` or use `overflow: truncate`"
    )
