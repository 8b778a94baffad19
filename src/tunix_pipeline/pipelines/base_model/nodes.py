import pandas as pd

from tunix_pipeline.config import ModelParams
from tunix_pipeline.ingest import record_texts
from tunix_pipeline.models import gemma_config, model_summary, read_hf_config, resolve_model_dir


def prepare_base_model(train_records: pd.DataFrame, model: ModelParams) -> dict:
    """The base model's folder: built (`tiny`, its tokenizer trained on the train records), local, or downloaded."""
    corpus = record_texts(train_records) if model.source == "tiny" else ()
    folder = resolve_model_dir(model, corpus)
    return {
        "path": str(folder),
        "source": model.source,
        "architecture": model_summary(gemma_config(read_hf_config(folder))),
    }
