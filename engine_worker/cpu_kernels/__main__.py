"""``python -m engine_worker.cpu_kernels``: build the native CPU kernels now and say where they are.

``make run`` and ``make test`` call it after installing, so the first engine does not pay the
few seconds of compilation; it exits 0 either way (engines fall back to torch without them).
"""

from __future__ import annotations

import logging
import sys

from engine_worker import cpu_kernels

logging.basicConfig(level=logging.INFO, format="%(message)s")
if cpu_kernels.available():
    print(f"zserve native CPU kernels: {cpu_kernels.library_path()}")
else:
    print("zserve native CPU kernels: unavailable here; engines use the torch path", file=sys.stderr)
