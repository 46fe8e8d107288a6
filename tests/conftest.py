"""Fixtures shared by unit and end-to-end tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.helpers import free_port, start_redis, stop_process

REDIS_MISSING = "redis-server is not installed (.ci/run installs it)"


@pytest.fixture(scope="session")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A private redis-server on a free loopback port, in a temp dir, persisting nothing; stopped afterwards."""
    if shutil.which("redis-server") is None:
        pytest.skip(REDIS_MISSING)
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield port
    finally:
        stop_process(proc)
