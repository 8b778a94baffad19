import pandas as pd

from tunix_pipeline.config import FormatParams
from tunix_pipeline.data.formatting import format_records
from tunix_pipeline.models import load_tokenizer


def format_split(records: pd.DataFrame, base_model: dict, params: FormatParams) -> pd.DataFrame:
    return format_records(records, load_tokenizer(base_model["path"]), params)
