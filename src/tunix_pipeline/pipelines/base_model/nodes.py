import pandas as pd

from tunix_pipeline.config import ModelParams
from tunix_pipeline.data.ingest import record_texts
from tunix_pipeline.models import model_summary, resolve_model_dir, tunix_config


def prepare_base_model(train_records: pd.DataFrame, model: ModelParams) -> dict:
    """The base model's folder: built (`tiny`, its tokenizer trained on the train records), local, or downloaded."""
    corpus = record_texts(train_records) if model.source == "tiny" else ()
    folder = resolve_model_dir(model, corpus)
    family, config = tunix_config(folder)  # an unsupported model fails here, before any tokenizing
    return {"path": str(folder), "source": model.source, "family": family.name, "architecture": model_summary(config)}
