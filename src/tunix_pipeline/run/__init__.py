"""What runs the pipeline: hooks into Kedro, the checks before a run, the session ledger, the config loader, one run
per output root."""
