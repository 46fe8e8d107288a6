"""The shipped deployment files hold together: the Kubernetes manifests (deploy/kubernetes), the Dockerfile and
the nginx config (deploy/nginx; tests/e2e/test_nginx.py runs it). Static checks, no cluster: every container's
command is parsed by `launch`'s own CLI (so a misspelled option or subcommand fails here), and what one manifest
says about another (names, ports, labels, keys) is checked against that other."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import click
import pytest
import yaml

from launch.cli import main as launch_cli
from launch.hosts.engine_registry import KV_PORTS_PER_ENGINE, kv_events_ports
from tests.helpers import ROOT

K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
NGINX = ROOT / "deploy" / "nginx" / "zserve.conf"
KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler", "StatefulSet", "PodDisruptionBudget", "Secret"}
WORKLOADS = ("Deployment", "StatefulSet")


def _load(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _load(path):
            doc["__file__"] = path.name
            out.append(doc)
    return out


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def launch_params(container: dict) -> tuple[str, dict]:
    """The `launch` subcommand a container runs and its options, as launch's CLI parses them (defaults filled)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv[0] == "launch", argv
    sub = argv[1]
    assert sub in launch_cli.commands, f"launch has no subcommand {sub!r}"
    command = launch_cli.commands[sub]
    try:
        ctx = command.make_context(sub, list(argv[2:]))
    except click.UsageError as e:
        pytest.fail(f"launch {sub} {' '.join(argv[2:])}: {e}")
    return sub, ctx.params


def kv_event_ports(params: dict) -> list[int]:
    """The KV event ports (PUB, replay) of every engine a `launch engine` container starts, as its supervisor
    picks them."""
    first = kv_events_ports(params["bind"], len(params["models"]), params["kv_events_port"]).start
    return [first + KV_PORTS_PER_ENGINE * r + k for r in range(params["engines"]) for k in range(KV_PORTS_PER_ENGINE)]


def matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def workload_for(docs: list[dict], selector: dict) -> dict:
    found = [w for kind in WORKLOADS for w in of_kind(docs, kind)
             if matches(selector, w["spec"]["template"]["metadata"]["labels"])]
    assert len(found) == 1, f"selector {selector} matches {len(found)} workloads"
    return found[0]


def pre_stop_seconds(container: dict) -> float:
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    cmd = hook["exec"]["command"]
    assert cmd[0] == "sleep" and len(cmd) == 2, cmd
    return float(cmd[1])


def probe_window(probe: dict) -> float:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


# -- Kubernetes ---------------------------------------------------------------------------------------------
def test_every_kind_is_there_and_the_kustomization_lists_the_manifests(docs):
    assert KINDS <= {d["kind"] for d in docs}
    for d in docs:
        assert d.get("apiVersion"), d
        assert d["kind"] == "Kustomization" or d["metadata"].get("name"), d
    kustomization = _load(K8S / "kustomization.yaml")[0]
    resources = kustomization["resources"]
    assert all((K8S / r).is_file() for r in resources), resources
    # Every manifest but the Secret's template is applied (applying the template would overwrite the real keys).
    files = {d["__file__"] for d in docs if d["kind"] != "Kustomization"}
    secret_files = {d["__file__"] for d in of_kind(docs, "Secret")}
    assert set(resources) == files - secret_files
    assert not any(d["kind"] == "Secret" for r in resources for d in _load(K8S / r))


def test_the_gateway_probes_health_and_tolerates_a_slow_start(docs):
    gw = one(docs, "Deployment", "zserve-gateway")
    (c,) = containers(gw)
    sub, params = launch_params(c)
    assert sub == "api-server" and params["host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == params["port"] == 8000
    for name in ("readinessProbe", "startupProbe"):
        get = c[name]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ("http", 8000), name
    # The startup probe waits as long as the server itself may take to become ready.
    assert probe_window(c["startupProbe"]) > params["ready_timeout"]
    # Liveness must not be /health: its 503 means "no engine", which restarting gateways would not fix.
    assert c["livenessProbe"].get("httpGet", {}).get("path") != "/health"


def test_the_engine_gets_a_gpu_and_tcp_probes_on_its_registry(docs):
    eng = one(docs, "StatefulSet", "zserve-engine")
    (c,) = containers(eng)
    sub, params = launch_params(c)
    assert sub == "engine"
    for part in ("requests", "limits"):
        assert int(c["resources"][part]["nvidia.com/gpu"]) >= params["engines"], part
    bind = urlsplit(params["bind"])
    assert bind.scheme == "tcp" and bind.hostname == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["registry"] == bind.port
    # Engine rank r listens on the registry's port + 1 + r: each is a container port.
    assert {bind.port + 1 + r for r in range(params["engines"])} <= set(ports.values())
    # ... and publishes its KV cache events on two ports of its own: each is a container port too.
    assert set(kv_event_ports(params)) <= set(ports.values())
    for name in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[name]["tcpSocket"]["port"] in ("registry", bind.port), name
    assert probe_window(c["startupProbe"]) > params["ready_timeout"]


def test_the_kustomization_moves_every_image_to_the_registry(docs):
    """kustomization.yaml's images: override names every workload's image (docs/deploy.md pushes them there);
    tests/unit/test_deploy_recipes.py checks the names against the recipe's docker build and push."""
    overrides = {i["name"] for i in _load(K8S / "kustomization.yaml")[0]["images"]}
    for kind in WORKLOADS:
        for w in of_kind(docs, kind):
            for c in containers(w):
                assert c["image"].partition(":")[0] in overrides, (w["metadata"]["name"], c["image"])


def test_the_grace_period_outlasts_the_drain_and_the_pre_stop_sleep(docs):
    for kind in WORKLOADS:
        for w in of_kind(docs, kind):
            spec = w["spec"]["template"]["spec"]
            for c in spec["containers"]:
                _, params = launch_params(c)
                sleep = pre_stop_seconds(c)
                assert sleep > 0, f"{w['metadata']['name']}: a preStop sleep takes the pod out of the endpoints first"
                assert spec["terminationGracePeriodSeconds"] > params["shutdown_timeout"] + sleep, w["metadata"]["name"]


def test_gateways_reach_the_engine_pods_through_the_headless_service(docs):
    eng = one(docs, "StatefulSet", "zserve-engine")
    svc = one(docs, "Service", eng["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"  # headless: each pod has a DNS name
    _, eng_params = launch_params(containers(eng)[0])
    registry = urlsplit(eng_params["bind"]).port
    svc_ports = {p["port"] for p in svc["spec"]["ports"]}
    assert {registry + 1 + r for r in range(eng_params["engines"])} | {registry} <= svc_ports
    assert set(kv_event_ports(eng_params)) <= svc_ports
    addresses = []
    for w in of_kind(docs, "Deployment"):
        for c in containers(w):
            _, params = launch_params(c)
            addresses += params.get("remote_engines", ())
    assert addresses, "no gateway names an --engine"
    for address in addresses:
        url = urlsplit(address)
        pod, _, service = url.hostname.partition(".")
        m = re.fullmatch(rf"{re.escape(eng['metadata']['name'])}-(\d+)", pod)
        assert m and int(m.group(1)) < eng["spec"].get("replicas", 1), address
        assert service == svc["metadata"]["name"] and url.port == registry, address


def test_selectors_match_the_pods_they_mean(docs):
    for svc in of_kind(docs, "Service"):
        w = workload_for(docs, svc["spec"]["selector"])
        names = {p.get("name") for c in containers(w) for p in c["ports"]}
        numbers = {p["containerPort"] for c in containers(w) for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert target in names or target in numbers, (svc["metadata"]["name"], target)
    for w in (w for kind in WORKLOADS for w in of_kind(docs, kind)):
        assert matches(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
    pdbs = {workload_for(docs, pdb["spec"]["selector"]["matchLabels"])["metadata"]["name"]
            for pdb in of_kind(docs, "PodDisruptionBudget")}
    assert pdbs == {"zserve-gateway", "zserve-engine"}
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    gw = one(docs, target["kind"], target["name"])
    assert "replicas" not in gw["spec"]  # the autoscaler owns it
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert all(c["resources"]["requests"]["cpu"] for c in containers(gw))  # utilization is relative to it


def test_keys_come_read_only_from_the_secret_and_only_what_each_side_needs(docs):
    (secret,) = of_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "zserve-keys"
    stored = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    need = {"engine": {"server.key_secret", "authorized/client.key"}, "api-server": {"server.key", "client.key_secret"}}
    for w in (w for kind in WORKLOADS for w in of_kind(docs, kind)):
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            sub, params = launch_params(c)
            (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == params["keys_dir"]]
            assert mount.get("readOnly") is True
            source = volumes[mount["name"]]["secret"]
            assert source["secretName"] == "zserve-keys" and source["defaultMode"] == 0o400
            assert {i["key"] for i in source["items"]} <= stored
            assert {i["path"] for i in source["items"]} == need[sub], w["metadata"]["name"]


def test_pods_run_as_non_root_on_a_read_only_root_with_writable_scratch_dirs(docs):
    for w in (w for kind in WORKLOADS for w in of_kind(docs, kind)):
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["capabilities"]["drop"] == ["ALL"] and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            scratch = {m["mountPath"] for m in c["volumeMounts"] if "emptyDir" in volumes[m["name"]]}
            # zserve's run dir ($XDG_RUNTIME_DIR, else /tmp) and its cache dir ($XDG_CACHE_HOME) are writable.
            assert {"/tmp", env["XDG_RUNTIME_DIR"], env["XDG_CACHE_HOME"]} <= scratch, w["metadata"]["name"]
            for p in c["ports"]:
                assert len(p["name"]) <= 15  # an IANA_SVC_NAME


def test_the_manifests_build_with_kustomize_where_kubectl_is_installed():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (optional: `kubectl kustomize` renders deploy/kubernetes)")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(out.stdout) if d}
    assert kinds == KINDS - {"Secret"}


# -- Dockerfile ----------------------------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                           if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def instruction(name: str) -> list[str]:
    return [rest for word, rest in dockerfile() if word == name]


def test_the_dockerfile_runs_launch_as_a_non_root_user():
    import orjson

    assert instruction("FROM") == ["python:3.11-slim"]
    (entrypoint,) = instruction("ENTRYPOINT")
    (cmd,) = instruction("CMD")
    assert orjson.loads(entrypoint) == ["launch"]
    argv = orjson.loads(cmd)
    sub, params = launch_params({"command": ["launch"], "args": argv})
    assert sub == "api-server" and params["host"] == "0.0.0.0" and params["port"] == 8000
    *_, user = instruction("USER")  # the last USER is the one the container runs as
    assert user.split(":")[0] not in ("root", "0")
    assert instruction("STOPSIGNAL") == ["SIGTERM"]
    assert {"8000", "7100"} <= set(" ".join(instruction("EXPOSE")).split())
    (health,) = instruction("HEALTHCHECK")
    assert "urllib" in health and "/health" in health and "curl" not in health
    # The torch pin the Makefile installs, from an index the build chooses (CPU by default).
    make = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)", make, re.M).group(1)
    args = dict(a.split("=", 1) for a in instruction("ARG"))
    assert args["TORCH_SPEC"] == pin and args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    models = re.search(r"^MODEL_PKGS\s*\?=\s*(.+)$", make, re.M).group(1).strip()
    assert args["MODEL_PKGS"].strip('"') == models
    # Everything the image copies is in the build context (.dockerignore lets it through).
    ignore = (ROOT / ".dockerignore").read_text().split()
    for rest in instruction("COPY"):
        for src in rest.split()[:-1]:
            assert (ROOT / src).exists() and f"!{src.rstrip('/')}" in ignore, src


# -- nginx ---------------------------------------------------------------------------------------------------
def test_the_nginx_config_streams_unbuffered_and_retries_no_post():
    text = "\n".join(line.split("#", 1)[0] for line in NGINX.read_text().splitlines())  # live directives only
    location = text[text.index("location / {"):]
    location = location[:location.index("}")]
    for d in ("proxy_buffering off", "proxy_cache off", "proxy_http_version 1.1", 'proxy_set_header Connection ""',
              "proxy_next_upstream error timeout"):
        assert d in location, d
    assert "non_idempotent" not in text  # POSTs are never passed to another server once sent
    assert int(re.search(r"proxy_read_timeout (\d+)s", location).group(1)) >= 600  # streams run for minutes
    assert re.search(r"^\s*least_conn;", text, re.M)
    assert re.search(r"server unix:\S+ max_fails=\d+ fail_timeout=\d+s", text)
    assert "location = /health" in text and "client_max_body_size" in text
