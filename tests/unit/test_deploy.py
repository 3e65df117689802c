"""deploy/k8s: every manifest is valid for Kubernetes (checked offline against its schemas, in
strict mode), and the pieces agree with one another and with sluicegate's own command line:
flags, ports, probes, the drain's timing, the tenants file and the JWT secret."""

from __future__ import annotations

import copy
import tomllib
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from policies.jwt import JWTVerifier
from policies.tenants import TenantsFileError, load_tenants
from tests.support.deploy import (
    DEPLOY,
    DRAIN_MARGIN_S,
    IMAGES,
    K8S,
    ROOT,
    Image,
    container_env,
    container_port,
    invocation,
    k8s_files,
    k8s_objects,
    load_yaml,
)

# the newest Kubernetes whose schemas kubernetes-validate ships (it refuses newer ones)
K8S_VERSION = "1.37"


def pod_spec(kind: str, name: str) -> dict:
    return k8s_objects()[kind, name]["spec"]["template"]["spec"]


def only_container(kind: str, name: str) -> dict:
    (container,) = pod_spec(kind, name)["containers"]
    return container


def gateway() -> dict:
    return only_container("Deployment", "sluicegate-gateway")


def worker() -> dict:
    return only_container("StatefulSet", "sluicegate-worker")


def gateway_settings():
    c = gateway()
    return invocation(c["image"], c["args"], container_env(c)).serve()


def service_port(name: str, port: int) -> dict:
    """The port `port` of Service `name`; fails unless the Service has it."""
    (entry,) = [p for p in k8s_objects()["Service", name]["spec"]["ports"] if p["port"] == port]
    return entry


@pytest.mark.parametrize("path", k8s_files(), ids=lambda p: p.name)
def test_every_manifest_validates_against_the_kubernetes_schemas_strictly(path):
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert documents
    for document in documents:
        # raises on an invalid or unknown field, and on a kind it has no schema for
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)


def test_strict_validation_catches_a_misspelt_field():
    deployment = copy.deepcopy(k8s_objects()["Deployment", "sluicegate-gateway"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest_and_tags_the_images_with_the_version():
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == [p.name for p in k8s_files()]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    used = {
        c["image"]
        for obj in k8s_objects().values()
        if obj["kind"] in ("Deployment", "StatefulSet")
        for c in obj["spec"]["template"]["spec"]["containers"]
        if c["image"].split(":")[0] in IMAGES
    }
    assert used == {f"sluicegate-gateway:{version}", f"sluicegate-worker-cuda:{version}"}
    assert {(i["name"], i["newTag"]) for i in kustomization["images"]} == {
        (image.split(":")[0], version) for image in used
    }


def test_the_gateway_flags_exist_and_point_at_the_workers_redis_and_tenants():
    settings = gateway_settings()  # argparse fails on any flag `sluice serve` does not have
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert not settings.starts_local_workers
    # every worker pod by its stable name (through the headless Service), at the port the
    # worker listens on and the Service names
    workers = k8s_objects()["StatefulSet", "sluicegate-worker"]["spec"]
    service = workers["serviceName"]
    assert k8s_objects()["Service", service]["spec"]["clusterIP"] == "None"
    port = container_port(worker(), "http")
    assert service_port(service, port)["targetPort"] == "http"
    assert settings.worker_url == [
        f"http://sluicegate-worker-{i}.{service}:{port}" for i in range(workers["replicas"])
    ]
    redis = urlsplit(settings.redis_url)
    assert redis.scheme == "redis"
    target = service_port(redis.hostname, redis.port)["targetPort"]
    assert container_port(only_container("StatefulSet", redis.hostname), target) == redis.port


def test_the_worker_flags_exist_and_listen_where_the_service_and_probes_look(monkeypatch):
    c = worker()
    args = invocation(c["image"], c["args"], container_env(c)).worker(monkeypatch)
    assert (args.host, args.port, args.model, args.device) == ("0.0.0.0", 9000, "default", "cuda")
    assert container_port(c, "http") == args.port
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    entry = service_port("sluicegate-worker", args.port)
    assert container_port(c, entry["targetPort"]) == args.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert (get["path"], container_port(c, get["port"])) == ("/health", args.port), probe
    annotations = k8s_objects()["StatefulSet", "sluicegate-worker"]["spec"]["template"]
    assert annotations["metadata"]["annotations"]["prometheus.io/port"] == str(args.port)


def test_the_gateway_listens_where_its_service_probes_and_annotations_look():
    c, port = gateway(), gateway_settings().port
    assert container_port(c, "http") == port
    entry = service_port("sluicegate-gateway", port)
    assert container_port(c, entry["targetPort"]) == port
    ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    assert (ready["path"], container_port(c, ready["port"])) == ("/readyz", port)
    assert (live["path"], container_port(c, live["port"])) == ("/healthz", port)
    template = k8s_objects()["Deployment", "sluicegate-gateway"]["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)


def test_the_grace_period_covers_the_prestop_sleep_and_the_shutdown_timeout():
    c = gateway()
    sleep, seconds = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    grace = pod_spec("Deployment", "sluicegate-gateway")["terminationGracePeriodSeconds"]
    needed = float(seconds) + gateway_settings().shutdown_timeout + DRAIN_MARGIN_S
    assert grace >= needed, f"terminationGracePeriodSeconds {grace} < {needed}"


def test_the_gateways_scale_and_are_disrupted_one_at_a_time():
    deployment = k8s_objects()["Deployment", "sluicegate-gateway"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] > 1
    hpa = k8s_objects()["HorizontalPodAutoscaler", "sluicegate-gateway"]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "sluicegate-gateway",
    }
    assert 1 < hpa["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["maxReplicas"]
    # CPU utilisation is measured against the request: without one the HPA cannot scale
    assert gateway()["resources"]["requests"]["cpu"]
    pdb = k8s_objects()["PodDisruptionBudget", "sluicegate-gateway"]["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"].items() <= labels.items()


def test_every_service_selects_pods_and_every_workload_runs_as_its_image_user():
    objects = k8s_objects()
    workloads = [o for o in objects.values() if o["kind"] in ("Deployment", "StatefulSet")]
    for (kind, name), service in objects.items():
        if kind == "Service":
            selector = service["spec"]["selector"].items()
            assert [
                w
                for w in workloads
                if selector <= w["spec"]["template"]["metadata"]["labels"].items()
            ], name
    for workload in workloads:
        template = workload["spec"]["template"]
        assert (
            workload["spec"]["selector"]["matchLabels"].items()
            <= template["metadata"]["labels"].items()
        )
        (container,) = template["spec"]["containers"]
        if container["image"].split(":")[0] in IMAGES:
            user = template["spec"]["securityContext"]["runAsUser"]
            assert Image.of(container["image"]).user == f"{user}:{user}"


def test_the_tenants_configmap_is_the_example_file_mounted_where_tenants_points():
    example = (DEPLOY / "tenants.example.toml").read_text()
    configmap = k8s_objects()["ConfigMap", "sluicegate-tenants"]
    assert configmap["data"] == {"tenants.toml": example}
    (mount,) = [m for m in gateway()["volumeMounts"] if m["name"] == "tenants"]
    assert "subPath" not in mount  # a subPath mount never sees the ConfigMap's updates
    (volume,) = [
        v for v in pod_spec("Deployment", "sluicegate-gateway")["volumes"] if v["name"] == "tenants"
    ]
    assert volume["configMap"]["name"] == "sluicegate-tenants"
    assert gateway_settings().tenants == f"{mount['mountPath']}/tenants.toml"


def test_the_example_tenants_file_loads():
    config = load_tenants(DEPLOY / "tenants.example.toml")
    assert sorted(config.tenants) == ["acme", "internal"]
    assert config.tenants["acme"].safety is not None
    assert config.jwt is not None and config.jwt.algorithms == ("HS256",)


def test_the_jwt_secret_reaches_the_gateway_and_its_placeholder_is_refused(monkeypatch):
    jwt = load_tenants(DEPLOY / "tenants.example.toml").jwt
    (env,) = [e for e in gateway()["env"] if e["name"] == jwt.hs256_secret_env]
    ref = env["valueFrom"]["secretKeyRef"]
    secret = k8s_objects()["Secret", ref["name"]]
    placeholder = secret["stringData"][ref["key"]]
    monkeypatch.setenv(jwt.hs256_secret_env, placeholder)
    with pytest.raises(TenantsFileError, match="shorter than 32 bytes"):
        JWTVerifier(jwt)  # a gateway left with the placeholder does not start
    monkeypatch.setenv(jwt.hs256_secret_env, "x" * 32)
    JWTVerifier(jwt)
