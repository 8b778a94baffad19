"""The project's pipelines, one package per stage; node and dataset names of the training stages come from
`tunix_pipeline.stages`."""
