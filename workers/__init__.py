"""sluice workers: a model-serving process (engine loop + its own small HTTP API)."""
