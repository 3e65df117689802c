"""The safety window (design §3): a per-tenant policy's checkers see streamed text before it
leaves the gateway; text is held back only as far as they need, redacted where they say, and a
block ends the run with `content_filter`. Released text is never retracted.
"""
