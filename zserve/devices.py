"""Accelerator discovery for the supervisor, through cuda-python's driver API.

``cuInit`` + ``cuDeviceGetCount`` load the driver and count the visible GPUs without creating a
CUDA context, so the supervisor holds no GPU memory and forked children are not poisoned. No
driver (a CPU machine) simply means zero devices. The engine itself picks its torch device in
``engine_worker/device.py``; this module only decides which engine gets which index.
"""

from __future__ import annotations

import logging

log = logging.getLogger("zserve.devices")


def cuda_device_count() -> int:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python 12.x
        except ImportError:
            return 0
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, count = driver.cuDeviceGetCount()
        return int(count) if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception as e:  # no driver library (a CPU machine), or a broken one: serve on the CPU
        log.debug("no usable CUDA driver: %s", e)
        return 0


def engine_device(rank: int, num_devices: int) -> int | None:
    """The GPU index engine ``rank`` uses (round-robin over visible GPUs), or None for the CPU."""
    return rank % num_devices if num_devices > 0 else None
