"""The OpenAI-compatible gateway: HTTP API, SSE, runs, CLI."""

from common.aiohttp_internals import check_version

check_version()  # before any module here uses what the tested aiohttp range has
