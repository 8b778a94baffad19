import pandas as pd

from tunix_pipeline.config import TokenizeParams
from tunix_pipeline.readers import DataError
from tunix_pipeline.models import load_tokenizer
from tunix_pipeline.tokenization import tokenize_split


def tokenize(
    train_formatted: pd.DataFrame, eval_formatted: pd.DataFrame, base_model: dict, params: TokenizeParams
) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    tokenizer = load_tokenizer(base_model["path"])
    train_tokens, train_stats = tokenize_split(train_formatted, tokenizer, params)
    eval_tokens, eval_stats = tokenize_split(eval_formatted, tokenizer, params)
    if not len(train_tokens):
        raise DataError(
            f"tokenize: no training rows left at max_length={params.max_length} "
            f"(dropped: {train_stats['dropped_overlong']} overlong, "
            f"{train_stats['dropped_prompt_too_long']} with prompts that fill the length); "
            "raise `tokenize.max_length` or use `overflow: truncate`"
        )
    return train_tokens, eval_tokens, {"train": train_stats, "eval": eval_stats}
