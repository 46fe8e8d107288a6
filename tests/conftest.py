"""Fixtures shared by unit and end-to-end tests."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.helpers import free_port, start_redis, stop_process

# Under pytest-xdist (``make test``: two workers on two cores) the cores are shared: each worker's own torch work
# (the exactness tests against transformers) gets its share of them, and OpenMP threads that finish a parallel
# region sleep instead of spinning for the next one on a core the other worker needs (the servers the tests start
# inherit this). One test's torch work took 3x as long with both workers' threads spinning on the same cores.
# (Nothing imported above loads torch: the OpenMP setting must come before it.)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


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
