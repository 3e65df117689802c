"""Per-request policies: authentication (keys, JWT), the tenants file, quotas, idempotency."""
