"""The generated CLI reference (docs/reference/) says what the code does: every setting and
flag has help text, every flag is a setting, and the committed pages are what the generator
renders now."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.config import describe
from common.worker_settings import ENGINE_KEYS, WorkerConfig, worker_parser, worker_settings
from gateway.cli.reference import REFERENCE, render_serve, serve_parser, stale_pages
from gateway.cli.usage import build_parser as usage_parser
from gateway.settings import Settings
from policies.keys_cli import build_parser as keys_parser

LOADER_FLAGS = {"help", "config"}  # argparse's own, and the file every command may read


def flags_of(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.dest != "help"]


def commands() -> dict[str, argparse.ArgumentParser]:
    keys = keys_parser("sluice keys")
    (subs,) = [a for a in keys._actions if isinstance(a.choices, dict)]
    found = {"serve": serve_parser(), "worker": worker_parser(), "usage": usage_parser()}
    found.update({f"keys {name}": sub for name, sub in subs.choices.items()})
    return found


def test_every_setting_has_help_text():
    settings = [*describe(Settings, serve_parser()), *worker_settings()]
    missing = [s.key for s in settings if not s.help.strip()]
    assert not missing, f"settings without help (a flag's help= or setting(doc=…)): {missing}"


@pytest.mark.parametrize("name", list(commands()))
def test_every_flag_has_help_text(name):
    missing = [a.dest for a in flags_of(commands()[name]) if not (a.help or "").strip()]
    assert not missing, f"sluice {name}: flags without help: {missing}"


def test_every_flag_of_serve_and_worker_is_a_setting():
    serve = {f.name for f in dataclasses.fields(Settings)} | set(ENGINE_KEYS) | LOADER_FLAGS
    assert {a.dest for a in flags_of(serve_parser())} <= serve
    worker = {f.name for f in dataclasses.fields(WorkerConfig)} | LOADER_FLAGS
    assert {a.dest for a in flags_of(worker_parser())} <= worker


def test_the_serve_page_lists_every_setting_and_the_worker_table():
    page = render_serve()
    for s in describe(Settings):
        assert f"`{s.key}`" in page or s.key in ("upstreams", "models", "prices", "worker"), s.key
    for key in ENGINE_KEYS:
        assert f"`[worker] {key}`" in page
    assert "[upstreams.NAME]" in page
    assert '[models."ALIAS"]' in page


def test_the_committed_pages_are_what_the_generator_renders():
    stale = stale_pages(REFERENCE)
    assert not stale, (
        f"{', '.join(stale)} differ from the code: run `python -m gateway.cli.reference`"
    )
