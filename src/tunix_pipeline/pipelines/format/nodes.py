import pandas as pd

from tunix_pipeline.config import EvaluateParams, FormatParams
from tunix_pipeline.data.formatting import FORMATTED_COLUMNS, few_shot_examples, format_few_shot, format_records
from tunix_pipeline.models import load_tokenizer


def format_split(records: pd.DataFrame, base_model: dict, params: FormatParams) -> pd.DataFrame:
    return format_records(records, load_tokenizer(base_model["path"]), params)


def format_eval_few_shot(eval_records: pd.DataFrame, train_records: pd.DataFrame, base_model: dict,
                         params: FormatParams, evaluate: EvaluateParams) -> pd.DataFrame:
    """The eval rows, each prompt after `evaluate.few_shot` solved examples of the training split (never an eval
    row); no rows when it is 0."""
    if not evaluate.few_shot:
        return pd.DataFrame(columns=FORMATTED_COLUMNS)
    examples = few_shot_examples(train_records, evaluate.few_shot, evaluate.seed)
    return format_few_shot(eval_records, examples, load_tokenizer(base_model["path"]), params)
