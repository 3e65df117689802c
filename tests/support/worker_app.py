"""An in-process worker app (the real server, the tiny model already loaded) for tests."""

from __future__ import annotations

from pathlib import Path

from tests.support.waiting import until
from workers.config import WorkerConfig
from workers.server import create_worker_app
from workers.service import LoadedModel


async def started_worker_app(aiohttp_client, loaded: LoadedModel, model_dir: Path, **config):
    """The worker's test client, once its app answers /health; `config`: WorkerConfig fields."""
    settings = WorkerConfig(model=str(model_dir), device="cpu", dtype="float32", **config)
    client = await aiohttp_client(create_worker_app(settings, loaded=loaded))

    async def healthy() -> bool:
        return (await client.get("/health")).status == 200

    await until(healthy, "the worker app to become healthy")
    return client
