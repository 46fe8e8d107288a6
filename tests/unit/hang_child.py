"""A supervised child that reports ready, then blocks forever: the stand-in for a hung gateway loop."""

from __future__ import annotations

import sys
import time

from protocol.control import Ready
from zserve.proc import StatusPipe


def block_the_loop() -> None:
    while True:
        time.sleep(3600)  # like an event loop stuck in a blocking call: no heartbeat ever again


if __name__ == "__main__":
    StatusPipe(int(sys.argv[sys.argv.index("--status-fd") + 1])).send(Ready(index=0))
    block_the_loop()
