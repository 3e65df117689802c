"""Tracing's settings (docs/tracing.md): the flags, variables and their checks on `serve` and on
the worker, the endpoint a gateway hands its local workers, the tenants file's content opt-in,
and a caller's `traceparent` read as the W3C spec asks."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from common.tracing import parent_from, traces_url
from common.worker_settings import load_worker_config
from gateway.backends.from_settings import local_workers
from gateway.cli.main import build_parser
from gateway.settings import Settings, load_settings
from policies.tenants import TenantsFileError, load_tenants

ENDPOINT = "http://collector:4318"


def serve_flags(*argv: str) -> dict:
    args = build_parser().parse_args(["serve", *argv])
    return {k: v for k, v in vars(args).items() if k not in ("cmd", "func")}


def test_tracing_is_off_unless_an_endpoint_is_given():
    settings = load_settings(serve_flags(), environ={})
    assert (settings.otlp_endpoint, settings.trace_sample_ratio) == (None, 1.0)


def test_the_flags_and_the_variables_set_it():
    flags = serve_flags("--otlp-endpoint", ENDPOINT, "--trace-sample-ratio", "0.25")
    settings = load_settings(flags, environ={})
    assert (settings.otlp_endpoint, settings.trace_sample_ratio) == (ENDPOINT, 0.25)
    environ = {"SLUICE_OTLP_ENDPOINT": ENDPOINT, "SLUICE_TRACE_SAMPLE_RATIO": "0"}
    settings = load_settings(serve_flags(), environ=environ)
    assert (settings.otlp_endpoint, settings.trace_sample_ratio) == (ENDPOINT, 0.0)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("trace_sample_ratio", 1.5, "between 0 and 1"),
        ("trace_sample_ratio", -0.1, "between 0 and 1"),
        ("otlp_endpoint", "collector:4318", "http(s) URL"),
    ],
)
def test_a_bad_value_is_refused_naming_the_setting(field, value, words):
    with pytest.raises(ValueError, match=field) as info:
        Settings(**{field: value})
    assert words in str(info.value)


def test_serve_hands_its_endpoint_to_the_local_workers():
    traced = local_workers(Settings(otlp_endpoint=ENDPOINT, workers=2))
    assert all(w.command()[-2:] == ["--otlp-endpoint", ENDPOINT] for w in traced)
    (untraced,) = local_workers(Settings())
    assert "--otlp-endpoint" not in untraced.command()


def test_the_worker_takes_its_own_endpoint():
    config = load_worker_config(["--port", "1", "--otlp-endpoint", ENDPOINT], environ={})
    assert config.otlp_endpoint == ENDPOINT
    assert load_worker_config(["--port", "1"], environ={}).otlp_endpoint is None
    with pytest.raises((ConfigError, ValueError), match="otlp_endpoint"):
        load_worker_config(["--port", "1", "--otlp-endpoint", "collector"], environ={})


def test_the_traces_path_is_under_the_endpoint():
    assert traces_url(ENDPOINT) == f"{ENDPOINT}/v1/traces"
    assert traces_url(ENDPOINT + "/") == f"{ENDPOINT}/v1/traces"


def test_a_tenant_opts_into_content_with_trace_content(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.open]\ntrace_content = true\n[tenants.closed]\n")
    tenants = load_tenants(path).tenants
    assert (tenants["open"].trace_content, tenants["closed"].trace_content) == (True, False)
    path.write_text('[tenants.open]\ntrace_content = "yes"\n')
    with pytest.raises(TenantsFileError) as info:
        load_tenants(path)
    assert info.value.field == "trace_content"


@pytest.mark.parametrize(
    "header",
    [
        "",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero parent id
        "zz-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    ],
)
def test_a_malformed_traceparent_is_ignored(header):
    assert parent_from({"traceparent": header}) is None


def test_a_well_formed_traceparent_is_the_parent():
    context = parent_from(
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    )
    assert context is not None
    assert parent_from({}) is None
