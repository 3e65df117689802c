"""The backends a replica serves from: its settings' workers, pools and upstreams, the worker
processes it owns and supervises, and their health."""
