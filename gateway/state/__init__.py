"""State: the run stores (in-process and Redis), quotas and idempotency in Redis, the usage
ledger, and what a replica does while Redis is away. Every Redis client of the gateway is here."""
