import pandas as pd

from tunix_pipeline.config import IngestParams
from tunix_pipeline.data.ingest import ingest


def ingest_sources(params: IngestParams) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    return ingest(params)
