"""What the gateway and the worker processes share that is not the wire: logging. Torch-free."""
