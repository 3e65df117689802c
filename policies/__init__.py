"""Per-request policies: auth, quotas, idempotency and the safety window."""
