"""Throughput and wall-time benchmarks; each script prints one JSON object (`make bench` runs them all)."""
