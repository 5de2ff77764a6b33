"""The node process: transport loop, ingest, pipeline, warm-up, realtime settings, signals, its own process."""
