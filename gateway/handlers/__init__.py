"""Route handlers: parse, delegate, answer."""
