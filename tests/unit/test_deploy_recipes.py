"""docs/deploy.md's recipes, run as pasted in a scratch root, and what they leave behind.

Every ```bash block of the page runs (as root, `bash -e`, from the host's /opt/zserve) on the hosts its
`<!-- run on: HOST ... -->` comment names ("local" without one), unless a `<!-- not run: why -->` comment says
why not. Each host is a directory standing for its "/": the blocks' absolute paths (/etc, /opt, /run, /var,
/root) are moved under it, ~ is its /root. What cannot run here is a small stub on PATH that records its call:
systemctl (it checks the unit file is installed), ssh and scp (commands and copies on the named host's
directory), git, make (`make install` installs a `launch` that runs `launch keys` for real and parses every
other command line with launch's own CLI), docker, kubectl, nginx, haproxy, socat, usermod. useradd and
chown are real: the recipe's user `zserve` is created on this machine (and removed after, if it was not
there before), so owners, modes and what that user can read are the real thing.

Not covered here: systemd running the units (tests/e2e/test_systemd.py verifies them with systemd-analyze),
a real cluster, registry or second machine, and the servers themselves (the e2e tests start those).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from tests.unit.as_user import FailedAs, can_switch_user, run_as

DOC = ROOT / "docs" / "deploy.md"
USER = "zserve"
MAX_NOT_RUN = 1  # blocks that may opt out; each says why
STUBS = ("git", "make", "systemctl", "ssh", "scp", "docker", "kubectl", "nginx", "haproxy", "socat", "usermod",
         "useradd")
MOVED = re.compile(r"(?<![\w.:/~-])/(etc|opt|run|var|root)(?=/|\s|$|['\"])")


@dataclass
class Block:
    text: str
    hosts: tuple[str, ...]
    not_run: str | None
    line: int


def doc_blocks() -> list[Block]:
    text = DOC.read_text()
    out = []
    for m in re.finditer(r"```bash\n(.*?)```", text, re.S):
        before = text[:m.start()].rstrip().splitlines()
        prev = before[-1].strip() if before else ""
        hosts, not_run = ("local",), None
        if (c := re.fullmatch(r"<!--\s*run on:\s*(.+?)\s*-->", prev)):
            hosts = tuple(c.group(1).split())
        elif (c := re.fullmatch(r"<!--\s*not run:\s*(.+?)\s*-->", prev)):
            not_run = c.group(1)
        out.append(Block(m.group(1), hosts, not_run, text[:m.start()].count("\n") + 1))
    return out


# -- the stubs -------------------------------------------------------------------------------------------------
STUB = r'''
import json, os, shutil, subprocess, sys

name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
scratch, host_root = os.environ["RECIPE_SCRATCH"], os.environ["RECIPE_HOST_ROOT"]
host = os.path.basename(host_root)
with open(os.environ["RECIPE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": name, "args": args, "host": host, "cwd": os.getcwd()}) + "\n")


def fail(msg):
    print(f"{name} (stub): {msg}", file=sys.stderr)
    sys.exit(1)


def on_host(spec):
    """HOST:PATH -> that host's directory + PATH; a local path as it is."""
    if ":" in spec and not spec.startswith("/"):
        h, _, path = spec.partition(":")
        return os.path.join(scratch, h) + path
    return spec


if name == "ssh":
    h, command = args[0], " ".join(args[1:])  # ssh joins its arguments for the remote shell
    remote = os.path.join(scratch, h)
    if not os.path.isdir(remote):
        fail(f"no host {h}")
    env = dict(os.environ, RECIPE_HOST_ROOT=remote, HOME=os.path.join(remote, "root"))
    sys.exit(subprocess.run(["bash", "-e", "-c", command.replace(host_root, remote)], cwd=remote, env=env).returncode)
elif name == "scp":
    paths = [on_host(a) for a in args if not a.startswith("-")]
    *sources, dest = paths
    for src in sources:
        if not os.path.isfile(src):
            fail(f"{src}: No such file")
        if dest.endswith("/") and not os.path.isdir(dest):
            fail(f"{dest}: No such directory")
        shutil.copy(src, dest)  # as scp: the content and mode bits, owned by the login user (root)
elif name == "make":
    if args != ["install"]:
        fail(f"only make install is stubbed, not {args}")
    venv_bin = os.path.join(os.getcwd(), ".venv", "bin")
    os.makedirs(venv_bin, exist_ok=True)
    os.symlink(os.environ["RECIPE_LAUNCH_STUB"], os.path.join(venv_bin, "launch"))
elif name == "systemctl":
    verb, *units = args
    units = [u for u in units if not u.startswith("-")]
    for u in units:
        unit = u if "." in u else u + ".service"
        if not os.path.isfile(os.path.join(host_root, "etc/systemd/system", unit)):
            fail(f"Unit file {unit} does not exist")
elif name == "useradd":
    user = args[-1]
    try:
        import pwd
        pwd.getpwnam(user)  # every host of the test shares this machine's users: made once
    except KeyError:
        sys.exit(subprocess.run(["/usr/sbin/useradd", *args]).returncode)
elif name == "kubectl" and args[:3] == ["create", "secret", "generic"]:
    for a in args:
        if a.startswith("--from-file="):
            path = a.split("=", 1)[1].split("=")[-1]
            if not os.path.isfile(path):
                fail(f"{path}: no such file")
elif name == "socat":
    sys.stdin.read()  # what the pipe sends it
elif name == "docker" and args[:1] == ["build"]:
    if not os.path.isfile(os.path.join(args[-1], "Dockerfile")):
        fail(f"no Dockerfile in {args[-1]}")
'''

LAUNCH_STUB = r'''
import json, os, sys

args = sys.argv[1:]
if args[:1] == ["keys"]:
    os.execv(os.environ["RECIPE_REAL_LAUNCH"], ["launch", *args])
import click
from launch.cli import main
with open(os.environ["RECIPE_LOG"], "a") as f:
    f.write(json.dumps({"cmd": "launch", "args": args, "host": os.path.basename(os.environ["RECIPE_HOST_ROOT"]),
                        "cwd": os.getcwd()}) + "\n")
try:
    main.commands[args[0]].make_context(args[0], args[1:])
except (click.ClickException, KeyError) as e:
    sys.exit(f"launch (stub): {args}: {e}")
'''


@dataclass
class Recipe:
    scratch: Path
    log: list[dict]

    def root(self, host: str) -> Path:
        return self.scratch / host

    def path(self, host: str, absolute: str) -> Path:
        return self.root(host) / absolute.lstrip("/")

    def calls(self, cmd: str, host: str | None = None) -> list[list[str]]:
        return [c["args"] for c in self.log if c["cmd"] == cmd and host in (None, c["host"])]


def run_block(scratch: Path, host: str, text: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    root = scratch / host
    script = MOVED.sub(lambda m: f"{root}/{m.group(1)}", text)
    cwd = root / "opt" / "zserve"
    env = dict(env, RECIPE_HOST_ROOT=str(root), HOME=str(root / "root"))
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd if cwd.is_dir() else root, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def recipe():
    if not can_switch_user():
        pytest.skip("the recipe creates the system user zserve and chowns files to it: run the tests as root")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    had_user = _exists(USER)
    scratch = Path(tempfile.mkdtemp(prefix="zserve-recipe-"))
    os.chmod(scratch, 0o755)  # user zserve walks in to read its keys
    bin_dir = scratch / ".bin"
    bin_dir.mkdir()
    stub = bin_dir / "stub"
    stub.write_text(f"#!{sys.executable}\n{STUB}")
    launch_stub = bin_dir / "launch-stub"
    launch_stub.write_text(f"#!{sys.executable}\n{LAUNCH_STUB}")
    for p in (stub, launch_stub):
        p.chmod(0o755)
    for name in STUBS:
        (bin_dir / name).symlink_to(stub)
    log = scratch / ".log"
    hosts = sorted({h for b in doc_blocks() for h in b.hosts})
    for host in hosts:  # what each host has before the recipe: a clone in /opt/zserve, systemd, nginx
        root = scratch / host
        checkout = root / "opt" / "zserve"
        shutil.copytree(ROOT / "deploy", checkout / "deploy")
        shutil.copy(ROOT / "Dockerfile", checkout)
        for d in ("etc/systemd/system", "etc/nginx/conf.d", "root"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "root").chmod(0o700)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECIPE_SCRATCH=str(scratch),
               RECIPE_LOG=str(log), RECIPE_LAUNCH_STUB=str(launch_stub),
               RECIPE_REAL_LAUNCH=str(Path(sys.executable).parent / "launch"))
    try:
        for block in doc_blocks():
            if block.not_run:
                continue
            for host in block.hosts:
                r = run_block(scratch, host, block.text, env)
                assert r.returncode == 0, f"docs/deploy.md:{block.line} on {host}:\n{block.text}\n{r.stdout}{r.stderr}"
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        yield Recipe(scratch, calls)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not had_user and _exists(USER):
            subprocess.run(["userdel", USER], capture_output=True)


def _exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def mode_and_owner(path: Path) -> tuple[str, str]:
    st = path.stat()
    return oct(stat.S_IMODE(st.st_mode)), pwd.getpwuid(st.st_uid).pw_name


def environment_file(recipe: Recipe, host: str) -> dict[str, str]:
    """The env file as systemd reads it: the last assignment of a name counts."""
    env = {}
    for line in recipe.path(host, "/etc/zserve/zserve.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            env[k.strip()] = v.strip().replace(str(recipe.root(host)), "")  # back to the host's own paths
    return env


def unit_command(recipe: Recipe, host: str, unit: str) -> tuple[list[str], dict]:
    """The unit's ExecStart as systemd would run it (an unquoted $VAR split on whitespace), parsed by launch."""
    from launch.cli import main as launch_cli

    text = recipe.path(host, f"/etc/systemd/system/{unit}").read_text()
    (env_file,) = re.findall(r"^EnvironmentFile=-?(\S+)", text, re.M)
    assert env_file == "/etc/zserve/zserve.env" and recipe.path(host, env_file).is_file()
    env = environment_file(recipe, host)
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", text, re.M)
    argv = []
    for word in shlex.split(exec_start):
        argv += env.get(word[1:], "").split() if word.startswith("$") else [word]
    assert argv[0] == "/opt/zserve/.venv/bin/launch" and recipe.path(host, argv[0]).exists(), argv[0]
    ctx = launch_cli.commands[argv[1]].make_context(argv[1], argv[2:])
    return argv, ctx.params


def public_key(path: Path) -> bytes:
    import zmq.auth

    return zmq.auth.load_certificate(str(path))[0]


# -- tests that need no root -----------------------------------------------------------------------------------
def test_every_block_runs_somewhere_or_says_why_not():
    blocks = doc_blocks()
    assert len(blocks) >= 8
    assert sum(b.not_run is not None for b in blocks) <= MAX_NOT_RUN
    for b in blocks:
        assert b.not_run or b.hosts, b.line


def test_the_page_links_files_that_exist():
    for target in re.findall(r"\]\((\.\./[^)#]+)\)", DOC.read_text()):
        assert (DOC.parent / target).exists(), target


def test_the_images_the_recipe_pushes_are_the_ones_kustomize_deploys():
    """The docker build/push names of the Kubernetes block, and kustomization.yaml's images: override applied to
    the manifests' images (kubectl kustomize's rule: newName replaces the name, newTag the tag if given)."""
    (block,) = [b for b in doc_blocks() if "kubectl apply -k" in b.text]
    built: dict[str, list[str]] = {}
    pushed = set()
    for line in block.text.replace("\\\n", " ").splitlines():
        for command in line.split("#")[0].split("&&"):
            words = shlex.split(command)
            if words[:2] == ["docker", "build"]:
                built[words[words.index("-t") + 1]] = words
            elif words[:2] == ["docker", "push"]:
                pushed.add(words[2])
    k8s = ROOT / "deploy" / "kubernetes"
    override = {i["name"]: i for i in yaml.safe_load((k8s / "kustomization.yaml").read_text()).get("images", [])}
    deployed = {}
    for path in k8s.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("Deployment", "StatefulSet"):
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    name, _, tag = c["image"].partition(":")
                    o = override.get(name, {})
                    image = f"{o.get('newName', name)}:{o.get('newTag', tag)}"
                    deployed[image] = "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
    assert set(deployed) <= pushed <= set(built), (deployed, pushed, built)
    for image, gpu in deployed.items():
        cuda = any("TORCH_INDEX_URL=" in o and "/whl/cu" in o for o in built[image])
        assert cuda == gpu, f"{image}: {'a GPU pod needs' if gpu else 'a CPU pod needs no'} the CUDA torch build"


# -- the recipe, run -------------------------------------------------------------------------------------------
def test_etc_zserve_is_created_with_an_env_file_only_root_reads(recipe):
    for host in ("local", "engine-1", "gw-1", "gw-2"):
        assert recipe.path(host, "/etc/zserve").is_dir()
        assert mode_and_owner(recipe.path(host, "/etc/zserve/zserve.env")) == ("0o600", "root")
    assert pwd.getpwnam(USER).pw_shell.endswith("nologin")


def test_each_host_holds_only_its_own_keys_owned_by_zserve(recipe):
    want = {"engine-1": {"server.key", "server.key_secret", "authorized/gw-1.key", "authorized/gw-2.key"},
            "gw-1": {"server.key", "client.key_secret"}, "gw-2": {"server.key", "client.key_secret"}}
    for host, files in want.items():
        keys = recipe.path(host, "/etc/zserve/keys")
        found = {str(p.relative_to(keys)) for p in keys.rglob("*") if p.is_file()}
        assert found == files, host
        assert mode_and_owner(keys) == ("0o700", USER), host
        for f in files:
            assert mode_and_owner(keys / f) == ("0o600", USER), (host, f)


def test_a_second_gateway_host_is_accepted_beside_the_first(recipe):
    authorized = recipe.path("engine-1", "/etc/zserve/keys/authorized")
    gw1 = public_key(recipe.path("gw-1", "/etc/zserve/keys/client.key_secret"))
    gw2 = public_key(recipe.path("gw-2", "/etc/zserve/keys/client.key_secret"))
    assert gw1 != gw2
    assert public_key(authorized / "gw-1.key") == gw1  # not overwritten by gw-2's
    assert public_key(authorized / "gw-2.key") == gw2


def test_user_zserve_loads_each_hosts_keys_with_zserves_own_loader(recipe):
    from zserve.curve import CurveKeys

    engine_dir = str(recipe.path("engine-1", "/etc/zserve/keys"))

    def engine() -> list[str]:
        keys = CurveKeys.for_server(engine_dir)
        return sorted(k.decode() for k in keys.authorized)

    accepted = run_as(USER, engine)
    for host in ("gw-1", "gw-2"):
        gw_dir = str(recipe.path(host, "/etc/zserve/keys"))

        def gateway() -> list[str]:
            keys = CurveKeys.for_client(gw_dir)  # noqa: B023 - called at once
            return [keys.client_public.decode(), keys.server_public.decode()]

        client, server = run_as(USER, gateway)
        assert client in accepted, host
        assert server.encode() == public_key(recipe.path("engine-1", "/etc/zserve/keys/server.key"))


def test_launch_keys_never_overwrites_a_key(recipe):
    keys = [b for b in doc_blocks() if "launch keys" in b.text]
    home = recipe.root("local") / "root"
    before = {p: p.read_bytes() for p in home.rglob("*") if p.is_file()}
    for b in keys:
        line = next(ln for ln in b.text.splitlines() if "launch keys" in ln).split("#")[0]
        argv = shlex.split(line.replace("~", str(home)))
        r = subprocess.run([str(Path(sys.executable).parent / "launch"), *argv[1:]], capture_output=True, text=True)
        assert r.returncode != 0 and "never overwritten" in r.stderr, (line, r.stderr)
    assert {p: p.read_bytes() for p in home.rglob("*") if p.is_file()} == before


def test_the_units_command_lines_parse_with_each_hosts_env_file(recipe):
    _, engine = unit_command(recipe, "engine-1", "zserve-engine.service")
    assert engine["keys_dir"] == "/etc/zserve/keys" and engine["engines"] == 2
    assert recipe.path("engine-1", engine["keys_dir"]).is_dir()
    for host in ("gw-1", "gw-2"):
        _, gw = unit_command(recipe, host, "zserve.service")
        assert gw["remote_engines"] == ("tcp://engine-1:7100",) and gw["keys_dir"] == "/etc/zserve/keys", host
        assert gw["count"] == 4
    _, local = unit_command(recipe, "local", "zserve.service")
    assert local["uds"] == "/run/zserve/zserve.sock" and local["keys_dir"] is None
    assert ["enable", "--now", "zserve-engine"] in recipe.calls("systemctl", "engine-1")
    for host in ("local", "gw-1", "gw-2"):
        assert ["enable", "--now", "zserve"] in recipe.calls("systemctl", host), host


def test_the_unix_socket_of_the_env_file_is_nginx_upstream(recipe):
    _, local = unit_command(recipe, "local", "zserve.service")
    conf = recipe.path("local", "/etc/nginx/conf.d/zserve.conf").read_text()
    assert re.search(rf"^\s*server unix:{re.escape(local['uds'])}\b", conf, re.M)
    assert ["-aG", USER, "www-data"] in recipe.calls("usermod")
    # The unit's runtime directory holds the socket and lets the zserve group in.
    unit = recipe.path("local", "/etc/systemd/system/zserve.service").read_text()
    assert os.path.dirname(local["uds"]) == "/run/" + re.search(r"^RuntimeDirectory=(\S+)", unit, re.M).group(1)
    assert "RuntimeDirectoryMode=0750" in unit


def test_the_kubernetes_secret_holds_every_key_the_pods_mount(recipe):
    (create,) = [a for a in recipe.calls("kubectl") if a[:3] == ["create", "secret", "generic"]]
    stored = set()
    for a in create:
        if a.startswith("--from-file="):
            spec = a.split("=", 1)[1]  # KEY=PATH, or PATH (the key is its file name)
            stored.add(spec.split("=")[0] if "=" in spec else os.path.basename(spec))
    needed = set()
    for path in (ROOT / "deploy" / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            for v in (doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
                if v.get("secret", {}).get("secretName") == create[3]:
                    needed |= {i["key"] for i in v["secret"]["items"]}
    assert needed <= stored, needed - stored
    assert ["apply", "-k", "deploy/kubernetes"] in recipe.calls("kubectl")


def test_a_key_zserve_cannot_read_is_named_with_the_user(recipe):
    """The message a wrong owner gets (the recipe's chown left out): not "missing", but "not readable by zserve"."""
    from zserve.curve import CurveKeys

    keys = recipe.path("gw-1", "/etc/zserve/keys")
    os.chown(keys, 0, 0)
    try:
        with pytest.raises(FailedAs, match=rf"server.key is not readable by user {USER}\b.*chown -R {USER}: "):
            run_as(USER, lambda: CurveKeys.for_client(str(keys)) and None)
    finally:
        uid, gid = pwd.getpwnam(USER).pw_uid, pwd.getpwnam(USER).pw_gid
        os.chown(keys, uid, gid)
