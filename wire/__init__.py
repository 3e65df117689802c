"""The wire contract between the gateway and its workers: request bodies, limits, the event lines
a worker streams, and a run's share. Torch-free: both sides import it, and the gateway alone
installs without torch (tests/unit/test_torch_free.py)."""
