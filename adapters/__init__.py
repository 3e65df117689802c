"""Adapters: the only code that knows an upstream's wire format.

Everything past an adapter speaks the internal event model of `adapters.events`.
"""
