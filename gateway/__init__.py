"""The OpenAI-compatible gateway: HTTP API, SSE, runs, CLI."""
