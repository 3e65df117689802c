"""deploy/ read as the tools that run it would: the Kubernetes manifests, the compose file, the
Dockerfiles (with BuildKit's own parser), and each container's command line resolved by the
real `sluice` parsers, the image's environment included."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dockerfile
import yaml

from common.worker_settings import WorkerConfig, load_worker_config
from gateway.cli.main import build_parser
from gateway.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKER = DEPLOY / "docker"
# after --shutdown-timeout the drain still cancels the live runs, the streams write their ends
# and aiohttp closes the connections (its shutdown_timeout, 5 s, in gateway/cli/main.py): a grace
# period must cover the timeout plus this
DRAIN_MARGIN_S = 5
# image name -> its Dockerfile (the names the compose file, the manifests and docs/deploy.md use)
IMAGES = {
    "sluicegate-gateway": "gateway.Dockerfile",
    "sluicegate-worker": "worker.Dockerfile",
    "sluicegate-worker-cuda": "worker-cuda.Dockerfile",
}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def k8s_objects() -> dict[tuple[str, str], dict]:
    """Every object of deploy/k8s by (kind, name)."""
    objects = {}
    for path in k8s_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                objects[doc["kind"], doc["metadata"]["name"]] = doc
    return objects


@dataclass(frozen=True)
class Image:
    """What a Dockerfile's final stage gives a container: user, environment, entrypoint."""

    commands: tuple[dockerfile.Command, ...]  # the final stage's instructions

    @classmethod
    def of(cls, name: str) -> Image:
        """The image `name[:tag]` as built from its Dockerfile."""
        return cls.parse(DOCKER / IMAGES[name.split(":")[0]])

    @classmethod
    def parse(cls, path: Path) -> Image:
        commands = dockerfile.parse_file(str(path))
        last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
        return cls(tuple(commands[last_from:]))

    def all(self, cmd: str) -> list[dockerfile.Command]:
        return [c for c in self.commands if c.cmd == cmd]

    def one(self, cmd: str) -> dockerfile.Command:
        (command,) = self.all(cmd)
        return command

    @property
    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for command in self.all("ENV"):
            pairs = command.value
            env.update(zip(pairs[::2], pairs[1::2], strict=True))
        return env

    @property
    def entrypoint(self) -> list[str]:
        command = self.one("ENTRYPOINT")
        assert command.json, "ENTRYPOINT in exec form, so sluice is PID 1 and gets SIGTERM"
        return list(command.value)

    @property
    def user(self) -> str:
        return self.all("USER")[-1].value[0]

    def pip_installs(self) -> list[list[str]]:
        """The arguments of every `pip install` in a RUN, in order."""
        installs = []
        for run in self.all("RUN"):
            for step in run.value[0].split("&&"):
                words = shlex.split(step)
                if words[:2] == ["pip", "install"]:
                    installs.append(words[2:])
        return installs


@dataclass(frozen=True)
class Invocation:
    """A container's `sluice` command line as the real parsers read it, with its environment."""

    argv: list[str]  # after `sluice`
    env: dict[str, str]

    @property
    def subcommand(self) -> str:
        return self.argv[0]

    def serve(self) -> Settings:
        """`sluice serve`'s settings: its flags (unknown ones fail) over SLUICE_* variables."""
        assert self.subcommand == "serve", self.argv
        args = vars(build_parser().parse_args(self.argv))
        flags = {k: v for k, v in args.items() if k not in ("cmd", "func")}
        return load_settings(flags, self.env)

    def worker(self, _monkeypatch: object = None) -> WorkerConfig:
        """`sluice worker`'s settings: its flags (unknown ones fail) over SLUICE_* variables, as
        its loader reads them (the environment is passed in, so nothing is patched)."""
        assert self.subcommand == "worker", self.argv
        return load_worker_config(self.argv[1:], self.env)


def invocation(image: str, args: list[str], env: dict[str, str]) -> Invocation:
    """The image's ENTRYPOINT (`sluice …`) followed by `args`, in the image's environment with
    `env` over it."""
    built = Image.of(image)
    assert built.entrypoint[0] == "sluice", built.entrypoint
    return Invocation(built.entrypoint[1:] + list(args), {**built.env, **env})


def container_env(container: dict) -> dict[str, str]:
    """A Kubernetes container's literal environment (values from secrets are left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def container_port(container: dict, port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def seconds(duration: str) -> float:
    """A compose duration such as `45s`, `1m30s`."""
    total, number = 0.0, ""
    for ch in duration:
        if ch.isdigit() or ch == ".":
            number += ch
        else:
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
    assert not number, f"{duration!r} has no unit"
    return total
