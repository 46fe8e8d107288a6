"""What the benchmarks read about a process from /proc: its CPU time and the children it runs under a title.

CPU time is utime + stime in clock ticks (10 ms on most kernels), so a measured window should hold enough
requests that one tick is small beside the cost per request times the requests.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far (its threads included, its children not)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) * TICK_S


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(_stat_fields(int(entry.name))[1])
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def title(pid: int) -> str:
    """The process's title as ``ps`` shows it (setproctitle rewrites the command line)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def find_titled(root: int, prefix: str) -> dict[str, int]:
    """Title → pid of the processes below ``root`` whose title starts with ``prefix`` (``zserve: gateway``)."""
    return {t: p for p in descendants(root) if (t := title(p)).startswith(prefix)}


def pin(pid: int, cores: set[int]) -> None:
    """Pin every thread of ``pid`` to ``cores`` (sched_setaffinity on a pid moves only its main thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, FileNotFoundError):
            pass  # the thread ended meanwhile
