"""Runs: a chat completion whose life is independent of the connection that started it."""
