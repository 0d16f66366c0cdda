"""deploy/kubernetes: every overlay renders, every object is valid against the Kubernetes API's schemas, and
what the objects say agrees with our own command lines: probes ask the ports and paths the processes
serve, shutdown grace covers the drain, and every selector picks the pods it is meant to. No cluster runs
here (kube-apiserver is not installable), so this is all checked on the rendered objects."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .support import ROOT

KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
# An overlay with every component, as an operator would add them.
WITH_COMPONENTS = "cpu+components"
COMPONENTS = ("gateway-tls", "ingress-nginx")
# The Kubernetes release whose schemas the objects must satisfy (kubernetes-validate's newest).
KUBERNETES_VERSION = "1.37.0"

Object = dict[str, Any]


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        print("kubectl: installing Debian's kubectl")
        installed = subprocess.run(["apt-get", "install", "-y", "-q", "kubectl"], capture_output=True, text=True,
                                   timeout=600, check=False)
        found = shutil.which("kubectl")
        if found is None:
            pytest.skip(f"kubectl is missing and apt-get could not install it: {installed.stderr[-500:]}")
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Object]]:
    kubectl = _kubectl()
    combined = tmp_path_factory.mktemp("kustomize")

    def relative(folder: Path) -> str:  # kustomize takes no absolute path to a base
        return os.path.relpath(folder, combined)

    (combined / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "taco-llm",
        "resources": [relative(KUSTOMIZE / "overlays" / "cpu")],
        "components": [relative(KUSTOMIZE / "components" / name) for name in COMPONENTS],
    }))
    folders = {**{name: KUSTOMIZE / "overlays" / name for name in OVERLAYS}, WITH_COMPONENTS: combined}
    found: dict[str, list[Object]] = {}
    for name, folder in folders.items():
        result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120,
                                check=False)
        assert result.returncode == 0, f"kubectl kustomize {name}: {result.stderr}"
        found[name] = [item for item in yaml.safe_load_all(result.stdout) if item]
    return found


def _variants(rendered: dict[str, list[Object]]) -> Iterator[tuple[str, list[Object]]]:
    yield from rendered.items()


def _one(objects: list[Object], kind: str, name: str) -> Object:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def _workloads(objects: list[Object]) -> dict[str, Object]:
    """The pod-making objects by name."""
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")}


def _pod_spec(workload: Object) -> Object:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _container(workload: Object) -> Object:
    containers = _pod_spec(workload)["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def _matches(selector: Object | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions, or a Service's plain map) against labels."""
    if selector is None:
        return False
    plain = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(key) != value for key, value in plain.items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value, operator = labels.get(expression["key"]), expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if operator == "Exists" and value is None:
            return False
        if operator == "DoesNotExist" and value is not None:
            return False
    return True


def _selected(selector: Object | None, objects: list[Object]) -> set[str]:
    """The workloads whose pods the selector picks."""
    return {name for name, w in _workloads(objects).items()
            if _matches(selector, w["spec"]["template"]["metadata"]["labels"])}


def _pod_env(container: Object) -> dict[str, str]:
    """The container's environment as a kubelet would give it (field references get stand-in values)."""
    stand_ins = {"status.podIP": "10.1.2.3", "metadata.name": "worker-5d9c7b6f4-x2x7q"}
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = stand_ins[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _argv(container: Object) -> list[str]:
    """The command with $(VAR) references expanded as the kubelet expands them."""
    env = _pod_env(container)
    command = [*container.get("command", []), *container.get("args", [])]
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), part) for part in command]


def _option(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} given {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def _replace_option(argv: list[str], flag: str, value: str) -> list[str]:
    copy = list(argv)
    copy[copy.index(flag) + 1] = value
    return copy


def _port_number(container: Object, port: int | str) -> int:
    """A probe's or a Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert len(named) == 1, f"container {container['name']} has no port named {port!r}"
    return int(named[0])


def _mount_path(container: Object, volume: str) -> str:
    paths = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(paths) == 1, f"{container['name']} mounts volume {volume!r} {len(paths)} times"
    return str(paths[0])


def _volume(workload: Object, name: str) -> Object:
    found = [v for v in _pod_spec(workload).get("volumes", []) if v["name"] == name]
    assert len(found) == 1, f"{workload['metadata']['name']}: volume {name!r}"
    return found[0]  # type: ignore[no-any-return]


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {None: 1, "m": 0.001, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6,
            "G": 1e9, "T": 1e12}


def _quantity(text: str | int) -> float:
    found = _QUANTITY.match(str(text))
    assert found, f"not a Kubernetes quantity: {text!r}"
    return float(found.group(1)) * _FACTORS[found.group(2)]


def _probe_window(probe: Object) -> float:
    """Seconds from the first failed check until the kubelet acts (the defaults are Kubernetes')."""
    return float(probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3))


def _prestop_seconds(container: Object) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop")
    if pre_stop is None:
        return 0.0
    assert "sleep" in pre_stop, f"{container['name']}: a preStop other than sleep has an unknown length"
    return float(pre_stop["sleep"]["seconds"])


# The tests.


def test_every_overlay_renders_and_every_object_is_valid_kubernetes(rendered: dict[str, list[Object]]) -> None:
    import kubernetes_validate

    problems = []
    for variant, objects in _variants(rendered):
        for item in objects:
            try:
                kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                problems.append(f"{variant}: {item['kind']}/{item['metadata']['name']}: {error.message}")
        kinds = {o["kind"] for o in objects}
        assert {"Deployment", "DaemonSet", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy",
                "HorizontalPodAutoscaler", "ServiceAccount", "ConfigMap", "Namespace"} <= kinds, variant
        assert all(o["metadata"].get("namespace") == "taco-llm" for o in objects if o["kind"] != "Namespace")
    assert not problems, "\n".join(problems)


def test_the_lookahead_config_map_is_deploy_lookahead_s(rendered: dict[str, list[Object]]) -> None:
    ours = (ROOT / "deploy" / "lookahead" / "lookahead_cache_config.json").read_text()
    # kustomize reads no file outside its folder, so the base holds a copy: the two must not drift.
    assert (KUSTOMIZE / "base" / "lookahead_cache_config.json").read_text() == ours
    for variant, objects in _variants(rendered):
        maps = [o for o in objects
                if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("taco-llm-lookahead")]
        assert len(maps) == 1 and json.loads(maps[0]["data"]["lookahead_cache_config.json"]) == json.loads(ours)
        worker = _workloads(objects)["worker"]
        assert _volume(worker, "lookahead")["configMap"]["name"] == maps[0]["metadata"]["name"], variant


def _parse_worker(container: Object, objects: list[Object], scratch: Path) -> Any:
    """The worker's command through the worker's own parser. The lookahead folder is the ConfigMap's
    content written here (the mount exists only in a pod)."""
    from taco_llm.engine_worker.frontend.args import parse

    argv = _argv(container)
    assert argv[:2] == ["taco_llm", "worker"], argv
    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and "lookahead" in o["metadata"]["name"])
    scratch.mkdir(exist_ok=True)
    for name, text in config_map["data"].items():
        (scratch / name).write_text(text)
    assert _option(argv, "--lookahead-cache-config-dir") == _mount_path(container, "lookahead")
    return parse(_replace_option(argv, "--lookahead-cache-config-dir", str(scratch))[2:])


def _parse_cache_service(container: Object, scratch: Path) -> Any:
    """The cache service's command through its own parser; --shm-dir must exist, so it is checked against
    the mount and parsed as a folder that exists here."""
    from taco_llm.cache_service.config import parse

    argv = _argv(container)
    assert argv[:2] == ["taco_llm", "cache-service"], argv
    assert _option(argv, "--shm-dir") == _mount_path(container, "windows")
    return parse(_replace_option(argv, "--shm-dir", str(scratch))[2:])


def _parse_gateway(container: Object, scratch: Path) -> Any:
    """The gateway's command through its own parser. A certificate it names must lie in the mounted
    Secret; it is parsed with a test certificate in its place (the Secret exists only in a cluster)."""
    from taco_llm.gateway.__main__ import parse

    from .certificates import make_certificates

    argv = _argv(container)
    assert argv[:2] == ["taco_llm", "gateway"], argv
    if "--ssl-certfile" in argv:
        mount = _mount_path(container, "tls")
        for flag in ("--ssl-certfile", "--ssl-keyfile"):
            assert _option(argv, flag).startswith(mount + "/"), flag
        (scratch / "certificates").mkdir(parents=True, exist_ok=True)
        certificates = make_certificates(scratch / "certificates")
        argv = _replace_option(argv, "--ssl-certfile", str(certificates.server_cert))
        argv = _replace_option(argv, "--ssl-keyfile", str(certificates.server_key))
    return parse(argv[2:])


@pytest.fixture
def keep_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's flag parsing sets vLLM's reserved-core variable when offload is on; keep it to this test."""
    from taco_llm.engine_worker.vllm_internals import CPU_RESERVED_CORES_VAR

    monkeypatch.setenv(CPU_RESERVED_CORES_VAR, "1")


@pytest.mark.usefixtures("keep_environment")
def test_every_command_parses_and_the_parts_find_each_other(rendered: dict[str, list[Object]],
                                                           tmp_path: Path) -> None:
    for variant, objects in _variants(rendered):
        workloads = _workloads(objects)
        worker = _parse_worker(_container(workloads["worker"]), objects, tmp_path / variant)
        cache = _parse_cache_service(_container(workloads["cache-service"]), tmp_path)
        gateway = _parse_gateway(_container(workloads["gateway"]), tmp_path / variant)
        redis = _one(objects, "Service", "redis")
        redis_port = redis["spec"]["ports"][0]["port"]
        # Everyone reaches Redis by its Service: the registry (database 1) and the lookahead index (0).
        assert worker.registry is not None and worker.registry.url == f"redis://redis:{redis_port}/1"
        assert gateway.registry_url == worker.registry.url and gateway.engines == []
        assert cache.redis_url == f"redis://redis:{redis_port}/0"
        # Workers reach their node's cache service by its Service.
        cache_service = _one(objects, "Service", "cache-service")
        assert worker.cache_service == f"cache-service:{cache_service['spec']['ports'][0]['port']}"
        assert worker.engine.kv_transfer_config is not None and worker.lookahead is not None
        # Gateways dial the pod's own address, at the port the worker listens on.
        assert worker.grpc_host == "0.0.0.0"
        assert worker.registry.advertise_address == f"10.1.2.3:{worker.grpc_port}", variant
        assert gateway.host == "0.0.0.0"


@pytest.mark.usefixtures("keep_environment")
def test_probes_services_and_scrapes_ask_the_ports_and_paths_served(rendered: dict[str, list[Object]],
                                                                     tmp_path: Path) -> None:
    for variant, objects in _variants(rendered):
        workloads = _workloads(objects)
        worker_container = _container(workloads["worker"])
        worker = _parse_worker(worker_container, objects, tmp_path / variant)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            # The gRPC health service on the worker's port: NOT_SERVING (or closed) until the engine has loaded.
            assert _port_number(worker_container, worker_container[kind]["grpc"]["port"]) == worker.grpc_port
        assert _port_number(worker_container, "grpc") == worker.grpc_port
        assert _port_number(worker_container, "metrics") == worker.metrics_port
        annotations = workloads["worker"]["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == worker.metrics_port

        cache_container = _container(workloads["cache-service"])
        cache = _parse_cache_service(cache_container, tmp_path)
        for kind in ("readinessProbe", "livenessProbe"):
            assert _port_number(cache_container, cache_container[kind]["grpc"]["port"]) == cache.grpc_port

        gateway_container = _container(workloads["gateway"])
        gateway = _parse_gateway(gateway_container, tmp_path / variant)
        readiness = gateway_container["readinessProbe"]["httpGet"]
        # /health: 200 once a worker is ready, and it asks for no key (--api-key spares it alone).
        assert readiness["path"] == "/health" and _port_number(gateway_container, readiness["port"]) == gateway.port
        assert readiness.get("scheme", "HTTP") == ("HTTPS" if gateway.tls is not None else "HTTP"), variant
        assert _port_number(gateway_container, gateway_container["livenessProbe"]["tcpSocket"]["port"]) == gateway.port
        annotations = workloads["gateway"]["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == gateway.port
        assert annotations["prometheus.io/path"] == "/metrics"

        # Each Service's target port is a port its pods serve.
        for service in (o for o in objects if o["kind"] == "Service"):
            (target,) = _selected(service["spec"]["selector"], objects)
            for port in service["spec"]["ports"]:
                _port_number(_container(workloads[target]), port["targetPort"])


def test_shutdown_grace_covers_every_drain(rendered: dict[str, list[Object]]) -> None:
    from taco_llm.supervisor import STOP_GRACE_SECONDS

    for variant, objects in _variants(rendered):
        workloads = _workloads(objects)
        worker_container = _container(workloads["worker"])
        worker_argv = _argv(worker_container)
        drain = float(_option(worker_argv, "--shutdown-timeout"))
        grace = _pod_spec(workloads["worker"])["terminationGracePeriodSeconds"]
        # preStop, then SIGTERM: the drain, then the engine's shutdown (serve's supervisor allows a child
        # STOP_GRACE_SECONDS for that), all before the kubelet's SIGKILL.
        assert grace > _prestop_seconds(worker_container) + drain + STOP_GRACE_SECONDS, variant
        # A draining worker is NOT_SERVING: liveness must not kill it first, nor a worker whose engine
        # has only begun a long step.
        liveness = _probe_window(worker_container["livenessProbe"])
        assert liveness > drain and liveness >= float(_option(worker_argv, "--engine-stall-timeout")), variant
        # The startup probe's budget is a model load: 10 minutes at least (30 on GPUs).
        budget = _probe_window(worker_container["startupProbe"])
        assert budget >= (1800 if variant == "gpu" else 600), variant

        gateway_container = _container(workloads["gateway"])
        gateway_drain = float(_option(_argv(gateway_container), "--shutdown-timeout"))
        gateway_grace = _pod_spec(workloads["gateway"])["terminationGracePeriodSeconds"]
        assert _prestop_seconds(gateway_container) > 0, "the Service's endpoints need time to drop the pod"
        assert gateway_grace > _prestop_seconds(gateway_container) + gateway_drain, variant


def test_every_selector_picks_the_pods_it_is_meant_to(rendered: dict[str, list[Object]]) -> None:
    for variant, objects in _variants(rendered):
        workloads = _workloads(objects)
        assert set(workloads) == {"worker", "gateway", "cache-service", "redis"}
        for workload in workloads.values():  # a workload's own selector picks its pods, and no one else's
            assert _selected(workload["spec"]["selector"], objects) == {workload["metadata"]["name"]}
        services = {"gateway": "gateway", "cache-service": "cache-service", "redis": "redis",
                    "redis-headless": "redis"}
        for service, target in services.items():
            assert _selected(_one(objects, "Service", service)["spec"]["selector"], objects) == {target}, variant
        assert _one(objects, "Service", "redis-headless")["spec"]["clusterIP"] == "None"
        assert workloads["redis"]["spec"]["serviceName"] == "redis-headless"
        for budget in ("worker", "gateway"):
            pdb = _one(objects, "PodDisruptionBudget", budget)
            assert _selected(pdb["spec"]["selector"], objects) == {budget}, variant
        hpa = _one(objects, "HorizontalPodAutoscaler", "gateway")
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", "gateway")
        assert hpa["spec"]["minReplicas"] >= 2 and workloads["gateway"]["spec"]["replicas"] >= 2
        # A CPU utilization target needs a CPU request to be measured against.
        assert "cpu" in _container(workloads["gateway"])["resources"]["requests"]
        for constraint in _pod_spec(workloads["gateway"])["topologySpreadConstraints"]:
            assert _selected(constraint["labelSelector"], objects) == {"gateway"}
        # Each workload runs under its own account, with no API token.
        for name, workload in workloads.items():
            account = _pod_spec(workload)["serviceAccountName"]
            assert _one(objects, "ServiceAccount", account)["automountServiceAccountToken"] is False, name


def _allowed(policies: list[Object], objects: list[Object], source: str | None, target: str, port: str) -> bool:
    """Whether the NetworkPolicies let pods of `source` (None: a pod outside taco-llm, in another namespace)
    open a connection to `port` (a container port's name) of `target`'s pods."""
    workloads = _workloads(objects)
    target_labels = workloads[target]["spec"]["template"]["metadata"]["labels"]
    source_labels = workloads[source]["spec"]["template"]["metadata"]["labels"] if source else {}
    applying = [p for p in policies if _matches(p["spec"]["podSelector"], target_labels)
                and "Ingress" in p["spec"]["policyTypes"]]
    assert applying, f"no policy isolates {target}"
    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(p.get("port") in (port, _port_number(_container(workloads[target]),
                                                                                    port)) for p in ports):
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                if "namespaceSelector" in peer:
                    continue  # another namespace (Prometheus's): never a taco-llm pod
                if source is not None and _matches(peer.get("podSelector"), source_labels):
                    return True
    return False


def test_network_policies_let_in_only_who_must_dial(rendered: dict[str, list[Object]]) -> None:
    for variant, objects in _variants(rendered):
        policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        every = ("worker", "gateway", "cache-service", "redis")
        deny = _one(objects, "NetworkPolicy", "taco-llm-default-deny")
        assert _selected(deny["spec"]["podSelector"], objects) == set(every) and "ingress" not in deny["spec"]
        expected = {  # target, port: who may connect
            ("gateway", "http"): {None, *every},
            ("worker", "grpc"): {"gateway"},
            ("cache-service", "grpc"): {"worker"},
            ("redis", "redis"): {"worker", "gateway", "cache-service"},
        }
        for (target, port), sources in expected.items():
            for source in (None, *every):
                if source == target:
                    continue
                assert _allowed(policies, objects, source, target, port) == (source in sources), (
                    variant, source, target, port)
        # Prometheus's namespace scrapes the workers' metrics port, and nothing else of theirs.
        worker_policy = _one(objects, "NetworkPolicy", "worker-from-gateways")
        scraping = [rule for rule in worker_policy["spec"]["ingress"]
                    if any("namespaceSelector" in peer for peer in rule["from"])]
        assert [port["port"] for rule in scraping for port in rule["ports"]] == ["metrics"]


def test_workers_share_a_node_folder_with_their_node_s_cache_service(rendered: dict[str, list[Object]],
                                                                     tmp_path: Path) -> None:
    from taco_llm.cache_service.config import parse_size

    for variant, objects in _variants(rendered):
        workloads = _workloads(objects)
        worker, cache = workloads["worker"], workloads["cache-service"]
        worker_container, cache_container = _container(worker), _container(cache)
        # The same folder of the node's /dev/shm, where each side's flag says it is.
        folder = _volume(worker, "windows")["hostPath"]["path"]
        assert folder == _volume(cache, "windows")["hostPath"]["path"] and folder.startswith("/dev/shm/")
        assert _option(_argv(worker_container), "--apc-offload-shm-dir") == _mount_path(worker_container, "windows")
        assert _option(_argv(cache_container), "--shm-dir") == _mount_path(cache_container, "windows")
        # The init container hands the folder to the user both run as.
        (init,) = _pod_spec(cache)["initContainers"]
        user = _pod_spec(cache)["securityContext"]["runAsUser"]
        assert user == _pod_spec(worker)["securityContext"]["runAsUser"]
        assert f"chown {user}:{user}" in init["command"][-1]
        # vLLM's own /dev/shm: memory, not the container's 64 MB default.
        assert _volume(worker, "dshm")["emptyDir"]["medium"] == "Memory"
        assert _mount_path(worker_container, "dshm") == "/dev/shm"
        # The node's own cache service only, and one runs wherever a worker can.
        assert _one(objects, "Service", "cache-service")["spec"]["internalTrafficPolicy"] == "Local"
        for toleration in _pod_spec(worker).get("tolerations", []):
            assert toleration in _pod_spec(cache).get("tolerations", []), variant
        # ...and nowhere else: its memory is reserved on every node it runs on.
        for placement in ("nodeSelector", "affinity"):
            assert _pod_spec(cache).get(placement) == _pod_spec(worker).get(placement), (variant, placement)
        assert _pod_spec(worker)["nodeSelector"] == {"taco-llm.io/serving": "true"}
        # Guaranteed QoS: every container's requests equal its limits, for CPU and memory.
        for container in [*_pod_spec(cache)["initContainers"], *_pod_spec(cache)["containers"]]:
            resources = container["resources"]
            for resource in ("cpu", "memory"):
                assert resources["requests"][resource] == resources["limits"][resource], (container["name"], resource)
        # The blocks are the process's memory: the budget leaves it 1 GiB under the limit at least.
        budget = parse_size(_option(_argv(cache_container), "--memory"))
        assert _quantity(cache_container["resources"]["limits"]["memory"]) - budget >= 2**30, variant


def test_the_gpu_overlay_asks_for_a_gpu_and_lands_on_gpu_nodes(rendered: dict[str, list[Object]]) -> None:
    objects = rendered["gpu"]
    worker = _workloads(objects)["worker"]
    resources = _container(worker)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in _pod_spec(worker)["tolerations"]
    terms = _pod_spec(worker)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in (
        terms["nodeSelectorTerms"][0]["matchExpressions"])
    assert _container(worker)["image"].endswith(":cuda")
    claim = _volume(worker, "model-cache")["persistentVolumeClaim"]["claimName"]
    assert _one(objects, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    # The CPU overlay's thread setting is vLLM-CPU's alone.
    assert all(e["name"] != "VLLM_CPU_OMP_THREADS_BIND" for e in _container(worker).get("env", []))
    cpu_worker = _workloads(rendered["cpu"])["worker"]
    assert {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"} in _container(cpu_worker)["env"]


def test_the_ingress_streams_and_leaves_size_refusals_to_the_gateway(rendered: dict[str, list[Object]]) -> None:
    from taco_llm.gateway.args import DEFAULT_MAX_REQUEST_BODY_BYTES

    ingress = _one(rendered[WITH_COMPONENTS], "Ingress", "gateway")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    body = annotations["nginx.ingress.kubernetes.io/proxy-body-size"]
    assert body.endswith("m") and int(body[:-1]) * 2**20 > DEFAULT_MAX_REQUEST_BODY_BYTES
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == "gateway"
    service = _one(rendered[WITH_COMPONENTS], "Service", "gateway")
    assert backend["port"]["name"] in {port["name"] for port in service["spec"]["ports"]}
