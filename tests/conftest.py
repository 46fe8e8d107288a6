"""Fixtures shared by unit and end-to-end tests."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.helpers import free_port

REDIS_MISSING = "redis-server is not installed (.ci/run installs it)"


@pytest.fixture(scope="session")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A private redis-server on a free loopback port, in a temp dir, persisting nothing; stopped afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(REDIS_MISSING)
    import redis

    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=1)
    deadline = time.monotonic() + 10
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"redis-server exited with {proc.returncode}")
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"redis-server on port {port} did not answer within 10s")
            time.sleep(0.01)
        yield port
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
