"""The tagged-answer task's scoring: each generation read the three ways our own evaluation reads it."""

from tunix_pipeline.data.answers import readings


def process_results(doc: dict, results: list[str]) -> dict:
    read = readings(results[0], doc["answer"])
    return {"strict": float(read["strict"]), "lenient": float(read["lenient"]), "format": float(read["format"])}
