"""Test doubles for sluicegate's tests and benchmarks: a scripted in-process adapter, a scripted
OpenAI-compatible upstream server, and a tiny random model built in a second.

Not part of what a user installs (the package is left out of the distribution); tests and
`bench/` import it from the repository.
"""
