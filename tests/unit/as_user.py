"""Run a function as another user, for tests of what that user may read (root reads everything).

A forked child drops to the user's uid and gid and runs the function on the code already imported, so the
user needs no access to the interpreter or the checkout (both may live under a 0700 /root); its result, or
its exception's type and message, comes back as JSON through a pipe.
"""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Callable


class FailedAs(Exception):
    """The function raised in the child: ``kind`` is the exception's type name, the message its text."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def can_switch_user() -> bool:
    return os.geteuid() == 0


def run_as(user: str, fn: Callable[[], object]) -> object:
    """``fn()`` in a child running as ``user`` (JSON-serializable result); raises FailedAs for its exception."""
    entry = pwd.getpwnam(user)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            try:
                out = {"ok": fn()}
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = {"kind": type(e).__name__, "message": str(e)}
            os.write(w, json.dumps(out, default=str).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data or b'{"kind": "ChildDied", "message": "no reply"}')
    if "ok" not in out:
        raise FailedAs(out["kind"], out["message"])
    return out["ok"]
