"""Every environment variable zserve reads, sets or documents, written in one place.

The modules keep reading their variables where they use them; this tuple is their contract. docs/cli.md's
environment section is generated from it (``launch/cli_reference.py``), and tests/unit/test_environment.py fails
when a ``ZSERVE_*`` name written anywhere in the repository (code, deploy files, tests, docs), or a variable the
Python code reads by name, is missing here, or when an entry's ``read_by`` file no longer mentions it.
"""

from __future__ import annotations

from dataclasses import dataclass

SETTING = "setting"
"""Set by whoever runs zserve; read by zserve's own code."""
DEPLOY = "deploy"
"""Read by the files in deploy/ and the Dockerfile (systemd units, HAProxy, the image's health check), not by
Python."""
INTERNAL = "internal"
"""Set by zserve for the processes it starts; an operator has no reason to set them."""
TEST = "test"
"""Read by the tests only (opt-in checks, debugging aids); ``make test`` needs none of them."""

SCOPES: dict[str, str] = {
    SETTING: "Settings",
    DEPLOY: "Read by the deployment files",
    INTERNAL: "Set by zserve for its own processes",
    TEST: "For the tests",
}
"""Each scope's heading in the reference, in the order they are shown."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # what applies while it is unset, in words
    meaning: str
    # Repository paths that read it; an entry in parentheses names a reader outside the repository.
    read_by: tuple[str, ...]
    scope: str = SETTING


ENVIRONMENT: tuple[EnvVar, ...] = (
    # -- settings ----------------------------------------------------------------------------------------------
    EnvVar("ZSERVE_API_KEY", "no key",
           "API keys, separated by spaces, used when no `--api-key` is given. Read by `launch` only: the processes "
           "it starts never inherit it, so a key appears on no command line.",
           ("gateway/security.py", "launch/cli.py")),
    EnvVar("ZSERVE_ADMIN_KEY", "no key",
           "The admin routes' keys, separated by spaces, used when no `--admin-key` is given. Never inherited by "
           "the processes `launch` starts.",
           ("gateway/security.py", "launch/cli.py")),
    EnvVar("OPENAI_API_KEY", "no key", "`launch bench`: the key sent as Bearer, as `--api-key`.",
           ("launch/cli.py",)),
    EnvVar("ZSERVE_CPU_KERNELS", "`1`",
           "`0` (or `false`, `no`, `off`): engines on a CPU use torch's operations instead of the native kernels "
           "zserve compiles.",
           ("engine_worker/cpu_kernels/__init__.py",)),
    EnvVar("CXX", "`g++`", "The C++ compiler that builds the native CPU kernels.",
           ("engine_worker/cpu_kernels/__init__.py",)),
    EnvVar("ZSERVE_PRELOAD", "`1`",
           "`0` (or `false`, `no`, `off`): the supervisor starts each engine and gateway as a fresh interpreter "
           "instead of forking it from a zygote that has imported the tier's code (docs/operations.md).",
           ("launch/zygote.py",)),
    EnvVar("ZSERVE_RESTART_BACKOFF", "`0.5`",
           "Seconds before the supervisor restarts a child that exited unexpectedly; each further failure within "
           "a minute doubles it, up to 30 s (five failures in a minute: crash-looping). More than 0, at most 30.",
           ("launch/children.py",)),
    EnvVar("ZSERVE_WEIGHT_CACHE", "`1`",
           "`0` (or `false`, `no`, `off`): GGUF weights are converted at every start instead of once into the "
           "cache directory.",
           ("engine_worker/weight_cache.py",)),
    EnvVar("ZSERVE_PROFILE_DIR", "no profile",
           "A directory: each gateway runs under `cProfile` and writes `gateway-<index>-<pid>.prof` there when it "
           "drains (a developer's aid for the gateway benchmarks; it slows the gateway 2-3x).",
           ("gateway/server.py",)),
    EnvVar("ZSERVE_WEIGHT_CACHE_MIN_BYTES", "`16777216` (16 MiB)",
           "GGUF files smaller than this many bytes are converted at every start, not cached.",
           ("engine_worker/weight_cache.py",)),
    EnvVar("XDG_CACHE_HOME", "`~/.cache`",
           "Where `zserve/` holds what is slow to make and safe to reuse: compiled CPU kernels, converted "
           "weights, tokenizers built from GGUF files.",
           ("zserve/paths.py",)),
    EnvVar("XDG_RUNTIME_DIR", "the temporary directory (`$TMPDIR` or `/tmp`), as `zserve-UID/`",
           "Where `zserve/` holds each server's private run directory and the pointer to its control socket "
           "(what `launch status`, `scale`, `reload` and `stop` find a server by).",
           ("zserve/control.py",)),
    EnvVar("CUDA_VISIBLE_DEVICES", "every GPU",
           "Which GPUs the engines may use; engine r of a model takes a visible GPU round-robin. Read by the CUDA "
           "driver when the supervisor counts the GPUs, and by torch in each engine.",
           ("(the CUDA driver)",)),
    EnvVar("NOTIFY_SOCKET", "unset: no notifications",
           "systemd (`Type=notify`): where the supervisor sends READY, STOPPING and STATUS.",
           ("launch/systemd.py",)),
    EnvVar("WATCHDOG_USEC", "unset: no watchdog",
           "systemd (`WatchdogSec=`): the supervisor pings the watchdog every half of it (with `WATCHDOG_PID`, "
           "only the process it names).",
           ("launch/systemd.py",)),
    EnvVar("WATCHDOG_PID", "unset", "systemd: the process `WATCHDOG_USEC` is meant for.", ("launch/systemd.py",)),
    EnvVar("LISTEN_FDS", "unset: `launch` opens its own socket",
           "systemd socket activation (`zserve.socket`): the gateways serve the first socket systemd passes "
           "instead of `--host`/`--port` or `--uds` (only when `LISTEN_PID` is the supervisor's pid).",
           ("launch/systemd.py",)),
    EnvVar("LISTEN_PID", "unset", "systemd socket activation: the process `LISTEN_FDS` is meant for.",
           ("launch/systemd.py",)),
    # -- deployment files --------------------------------------------------------------------------------------
    EnvVar("ZSERVE_OPTS", "empty",
           "zserve.service: more `launch api-server` options, appended to its command line (set in "
           "/etc/zserve/zserve.env).",
           ("deploy/systemd/zserve.service",), DEPLOY),
    EnvVar("ZSERVE_ENGINE_OPTS", "empty",
           "zserve-engine.service: more `launch engine` options, appended to its command line.",
           ("deploy/systemd/zserve-engine.service",), DEPLOY),
    EnvVar("ZSERVE_HEALTH_URL", "`http://127.0.0.1:8000/health`",
           "The Docker image's health check: the URL it polls (another `--port`).",
           ("Dockerfile",), DEPLOY),
    EnvVar("ZSERVE_LB_BIND", "`:8080`", "deploy/haproxy/haproxy.cfg: the address HAProxy listens on.",
           ("deploy/haproxy/haproxy.cfg",), DEPLOY),
    EnvVar("ZSERVE_LB_ADMIN_SOCKET", "`/run/haproxy/admin.sock`",
           "deploy/haproxy/haproxy.cfg: HAProxy's admin socket (to drain a host).",
           ("deploy/haproxy/haproxy.cfg",), DEPLOY),
    EnvVar("ZSERVE_HOST_1", "`10.0.0.1:8000`", "deploy/haproxy/haproxy.cfg: the first gateway host.",
           ("deploy/haproxy/haproxy.cfg",), DEPLOY),
    EnvVar("ZSERVE_HOST_2", "`10.0.0.2:8000`", "deploy/haproxy/haproxy.cfg: the second gateway host.",
           ("deploy/haproxy/haproxy.cfg",), DEPLOY),
    # -- set by zserve -----------------------------------------------------------------------------------------
    EnvVar("ZSERVE_LOG_LEVEL", "`INFO`",
           "Every process's log level: `launch` sets it from `--log-level` before it starts any process.",
           ("launch/cli.py", "zserve/proc.py"), INTERNAL),
    EnvVar("PROMETHEUS_MULTIPROC_DIR", "unset: one process's metrics",
           "Set by the supervisor for its gateways (a directory in the run directory), so that any gateway's "
           "`/metrics` adds up all of theirs.",
           ("launch/supervisor/server.py", "gateway/metrics.py"), INTERNAL),
    EnvVar("GLOO_SOCKET_IFNAME", "`lo`",
           "Expert-parallel engines: the interface their group talks over (set to loopback unless already set).",
           ("engine_worker/expert_parallel.py",), INTERNAL),
    EnvVar("NCCL_SOCKET_IFNAME", "`lo`", "As `GLOO_SOCKET_IFNAME`, for NCCL on GPUs.",
           ("engine_worker/expert_parallel.py",), INTERNAL),
    # -- tests -------------------------------------------------------------------------------------------------
    EnvVar("ZSERVE_TEST_LOGS", "`/tmp/zserve-test-logs`",
           "Where the end-to-end tests write the logs of the servers they start.",
           ("tests/helpers.py",), TEST),
    EnvVar("ZSERVE_SOAK", "unset: skipped", "`1` runs the random-kill soak test (minutes long).",
           ("tests/soak/test_random_kills.py",), TEST),
    EnvVar("ZSERVE_SOAK_SECONDS", "`300`", "How long the soak test runs.",
           ("tests/soak/test_random_kills.py",), TEST),
    EnvVar("ZSERVE_SOAK_KILL_EVERY", "`10`", "Seconds between the soak test's kills of a random process.",
           ("tests/soak/test_random_kills.py",), TEST),
    EnvVar("ZSERVE_SOAK_SEED", "a fresh seed", "The soak test's random seed, to repeat a run.",
           ("tests/soak/test_random_kills.py",), TEST),
    EnvVar("ZSERVE_FAULT_FILE", "set by the test",
           "The supervisor test's wrapper of `launch`: its reconcile loop fails once this file exists.",
           ("tests/e2e/test_supervisor.py",), TEST),
)
"""Every variable, grouped by scope (``SCOPES``), each group in the order shown."""
