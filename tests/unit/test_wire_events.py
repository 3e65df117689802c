"""A worker's stream lines (wire/api.py) and the gateway's events (adapters/events.py) name the
same things the same way and in the same order, so a line reads as its event field for field;
what the gateway adds (a call's id, an error's type) or the worker adds (counts the gateway
reads elsewhere) are the only differences."""

from dataclasses import fields

import pytest

from adapters import events
from adapters.worker_client import to_event
from wire import api

PAIRS = [
    (api.AcceptedLine, events.Accepted),
    (api.AdmittedLine, events.Admitted),
    (api.TextLine, events.TextDelta),
    (api.ToolCallLine, events.ToolCallDelta),
    (api.FinishLine, events.Finish),
    (api.FinishLine, events.Aborted),
    (api.UsageLine, events.Usage),
    (api.ErrorLine, events.ErrorEvent),
]


def names(kind: type) -> list[str]:
    return [
        f.name for f in fields(kind) if not (kind.__module__ == api.__name__ and f.name == "type")
    ]


@pytest.mark.parametrize(("line", "event"), PAIRS, ids=lambda k: k.__name__)
def test_shared_fields_keep_one_order(line, event):
    shared = set(names(line)) & set(names(event))
    assert [n for n in names(line) if n in shared] == [n for n in names(event) if n in shared]


def test_every_line_type_has_its_event():
    assert set(api._LINES.values()) == {line for line, _ in PAIRS}


@pytest.mark.parametrize(
    "line",
    [
        api.AcceptedLine(7),
        api.AdmittedLine(),
        api.TextLine("ab", 1, 2, [{"token": "a"}], token_ids=[5, 6]),
        api.ToolCallLine(0, '{"x":1}', "f", 1, 3, token_ids=[1, 2, 3]),
        api.FinishLine("length", 1, 4),
        api.FinishLine("abort", 1, 4, 2, 1.5),
        api.UsageLine(3, 4),
    ],
    ids=lambda line: type(line).__name__ + "-" + getattr(line, "reason", ""),
)
def test_a_line_read_off_the_wire_is_its_event_field_for_field(line):
    event = to_event(api.decode(api.encode(line)))
    for name in set(names(type(line))) & set(names(type(event))):
        assert getattr(event, name) == getattr(line, name), name
