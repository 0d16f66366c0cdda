"""Docker for the compose tests and bench/compose_faults.py: the daemon (started when it is not running,
and stopped again by whoever started it), base images made from Debian's packages where no registry
answers, the image built from this repository with `make image`, and one compose project of
docker-compose.yml with the faults a cluster does to its hosts.

Every step prints what it does (these take minutes), and every docker command's output goes to a log
file whose tail is shown when it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .support import ROOT, free_port

PYTHON_BASE = "python:3.11-slim"
REDIS_IMAGE = "redis:7"
# Made from Debian's packages when the registry cannot be reached.
LOCAL_PYTHON_BASE = "taco-llm-base:bookworm"
LOCAL_REDIS = "taco-llm-redis:7-debian"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# The tests' own tag: a user's `make image` (taco-llm) is left as it is.
IMAGE = "taco-llm:test"
DAEMON_START_SECONDS = 60.0
PULL_TIMEOUT_SECONDS = 120.0

Say = Callable[[str], None]


class DockerUnavailable(Exception):
    """Docker cannot run here; the message says why."""


def _run(argv: Sequence[str], *, log: Path | None = None, timeout: float = 600, check: bool = True,
         env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Runs a command, its output kept (and appended to `log`); raises with the tail when it fails."""
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                            env={**os.environ, **(env or {})})
    if log is not None:
        with log.open("a") as file:
            file.write(f"$ {' '.join(argv)}\n{result.stdout}{result.stderr}\n")
    if check and result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
        raise RuntimeError(f"`{' '.join(argv)}` exited with {result.returncode}:\n{tail}")
    return result


def _run_logged(argv: Sequence[str], *, log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    """A long command (a build, `up`): its output goes to `log` as it comes, so that it can be followed
    (`tail -f`); raises with the log's tail when it fails."""
    with log.open("a") as file:
        file.write(f"$ {' '.join(argv)}\n")
        file.flush()
        code = subprocess.run(list(argv), stdout=file, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})}).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"`{' '.join(argv)}` exited with {code}:\n{tail}")


def _succeeds(argv: Sequence[str], timeout: float = 30) -> bool:
    try:
        return subprocess.run(list(argv), capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class Docker:
    """A docker client that builds with BuildKit, a compose command, and the daemon if we started it."""

    cli: str
    compose: list[str]
    log: Path
    daemon: subprocess.Popen[bytes] | None = None

    def run(self, *args: str, timeout: float = 600, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return _run([self.cli, *args], log=self.log, timeout=timeout, check=check, env=env)

    def has_image(self, name: str) -> bool:
        return self.run("image", "inspect", name, check=False).returncode == 0

    def stop_daemon(self) -> None:
        """Stops the daemon if this process started it (what it started, it stops)."""
        if self.daemon is None:
            return
        self.daemon.send_signal(signal.SIGTERM)
        try:
            self.daemon.wait(60)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait()
        self.daemon = None


def _client_version(cli: str) -> tuple[int, ...]:
    result = subprocess.run([cli, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True,
                            timeout=30)
    digits = result.stdout.strip().split("+")[0].split("-")[0]
    try:
        return tuple(int(part) for part in digits.split("."))
    except ValueError:
        return ()


def _buildkit_client() -> str | None:
    """A docker client that builds with BuildKit (the Dockerfile's secret and bind mounts need it): one with
    the buildx plugin, or a 20.x-22.x client, whose BuildKit is built in. A 23+ client without buildx cannot."""
    candidates = [path for path in (shutil.which("docker"), "/usr/bin/docker") if path and os.path.exists(path)]
    for cli in dict.fromkeys(candidates):
        if _succeeds([cli, "buildx", "version"]):
            return cli
        version = _client_version(cli)
        if version and version[0] < 23:
            return cli
    return None


def _compose_command(cli: str) -> list[str] | None:
    """The Compose v2 plugin where it exists, else docker-compose (v1)."""
    if _succeeds([cli, "compose", "version"]):
        return [cli, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def _install_docker(say: Say) -> None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DockerUnavailable("docker is not installed, and installing it needs root and apt-get")
    say("installing Debian's docker.io, docker-compose and debootstrap")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update"], timeout=600, check=False, env=env)
    result = _run(["apt-get", "install", "-y", "--no-install-recommends", "docker.io", "docker-compose",
                   "debootstrap", "iptables"], timeout=1200, check=False, env=env)
    if result.returncode != 0:
        raise DockerUnavailable(f"apt-get install docker.io failed: {result.stderr.strip()[-400:]}")


def ensure_docker(work: Path, say: Say) -> Docker:
    """A docker daemon that answers, started (and installed, as root on Debian) when missing; raises
    DockerUnavailable saying why it cannot be had."""
    log = work / "docker.log"
    if shutil.which("dockerd") is None or _buildkit_client() is None or _compose_command("docker") is None:
        _install_docker(say)
    cli = _buildkit_client()
    if cli is None:
        raise DockerUnavailable("no docker client with BuildKit (buildx, or a 20.x-22.x client) is installed")
    compose = _compose_command(cli)
    if compose is None:
        raise DockerUnavailable("neither `docker compose` nor docker-compose is installed")
    docker = Docker(cli, compose, log)
    if _succeeds([cli, "info"]):
        return docker
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise DockerUnavailable(f"no docker daemon answers and dockerd is not installed ({cli} info failed)")
    say("starting dockerd")
    daemon_log = (work / "dockerd.log").open("wb")
    docker.daemon = subprocess.Popen([dockerd], stdout=daemon_log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
    deadline = time.monotonic() + DAEMON_START_SECONDS
    while time.monotonic() < deadline:
        if docker.daemon.poll() is not None:
            tail = (work / "dockerd.log").read_text(errors="replace").splitlines()[-15:]
            docker.daemon = None
            raise DockerUnavailable("dockerd exited at start:\n" + "\n".join(tail))
        if _succeeds([cli, "info"]):
            return docker
        time.sleep(0.5)
    docker.stop_daemon()
    raise DockerUnavailable(f"dockerd did not answer within {DAEMON_START_SECONDS:.0f}s")


def _pull(docker: Docker, name: str) -> bool:
    try:
        return docker.run("pull", name, check=False, timeout=PULL_TIMEOUT_SECONDS).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _debian_python_base(docker: Docker, work: Path, say: Say) -> str:
    """A Debian base with Python 3.11, venv and headers, made with debootstrap from Debian's packages."""
    if docker.has_image(LOCAL_PYTHON_BASE):
        return LOCAL_PYTHON_BASE
    if shutil.which("debootstrap") is None:
        _install_docker(say)  # brings debootstrap
    root = Path(tempfile.mkdtemp(prefix="debootstrap-", dir=work))
    say(f"making {LOCAL_PYTHON_BASE} with debootstrap (about a minute)")
    try:
        _run_logged(["debootstrap", "--variant=minbase",
                     "--include=python3,python3-venv,python3-pip,python3-dev,ca-certificates",
                     DEBIAN_SUITE, str(root), DEBIAN_MIRROR], log=docker.log, timeout=1200)
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
        archive = root.with_suffix(".tar")
        _run(["tar", "-C", str(root), "-cf", str(archive), "."], log=docker.log, timeout=600)
        docker.run("import", "-c", 'CMD ["python3"]', "-c", "ENV LANG=C.UTF-8", str(archive), LOCAL_PYTHON_BASE,
                   timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        root.with_suffix(".tar").unlink(missing_ok=True)
    return LOCAL_PYTHON_BASE


@dataclass(frozen=True)
class BaseImages:
    python: str
    redis: str


def ensure_base_images(docker: Docker, work: Path, say: Say) -> BaseImages:
    """python:3.11-slim and redis:7 where they can be pulled; otherwise a Debian base and a Redis made
    from Debian's redis-server (deploy/docker/redis)."""
    python = PYTHON_BASE if docker.has_image(PYTHON_BASE) or _pull(docker, PYTHON_BASE) else None
    if python is None:
        say(f"{PYTHON_BASE} cannot be pulled: using a Debian base made here")
        python = _debian_python_base(docker, work, say)
    if docker.has_image(REDIS_IMAGE) or _pull(docker, REDIS_IMAGE):
        return BaseImages(python, REDIS_IMAGE)
    say(f"{REDIS_IMAGE} cannot be pulled: building {LOCAL_REDIS} from Debian's redis-server")
    docker.run("build", "--build-arg", f"BASE_IMAGE={python}", "-t", LOCAL_REDIS,
               str(ROOT / "deploy" / "docker" / "redis"), timeout=900)
    return BaseImages(python, LOCAL_REDIS)


def ca_bundle() -> str | None:
    """The CA bundle pip on this machine trusts ($PIP_CERT or $SSL_CERT_FILE), for a TLS-inspecting proxy."""
    for name in ("PIP_CERT", "SSL_CERT_FILE"):
        path = os.environ.get(name)
        if path and os.path.isfile(path):
            return path
    return None


def build_image(docker: Docker, base: str, say: Say, *, image: str = IMAGE, cached: bool = True) -> float:
    """`make image` with this base (without Docker's build cache unless `cached`); the seconds it took."""
    say(f"building {image} on {base} with `make image` (minutes when nothing is cached; output in {docker.log})")
    args = ["make", "image", f"DOCKER={docker.cli}", f"IMAGE={image}", f"BASE_IMAGE={base}"]
    if not cached:
        args.append("BUILD_FLAGS=--no-cache")
    bundle = ca_bundle()
    if bundle:
        args.append(f"PIP_CA_BUNDLE={bundle}")
    started = time.monotonic()
    _run_logged(args, log=docker.log, timeout=1800)
    return time.monotonic() - started


def image_size_bytes(docker: Docker, image: str = IMAGE) -> int:
    return int(docker.run("image", "inspect", image, "--format", "{{.Size}}").stdout.strip())


@dataclass
class ComposeProject:
    """One `docker compose -p NAME` project of docker-compose.yml."""

    docker: Docker
    name: str
    images: BaseImages
    image: str = IMAGE
    port: int = field(default_factory=free_port)
    cache_service_port: int = field(default_factory=free_port)

    @property
    def env(self) -> dict[str, str]:
        return {"TACO_LLM_IMAGE": self.image, "REDIS_IMAGE": self.images.redis, "TACO_LLM_PORT": str(self.port),
                "TACO_LLM_CACHE_SERVICE_PORT": str(self.cache_service_port)}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [*self.docker.compose, "-p", self.name, "-f", str(ROOT / "docker-compose.yml"), *args]
        return _run(argv, log=self.docker.log, timeout=timeout, check=check, env=self.env)

    def up(self, workers: int) -> None:
        argv = [*self.docker.compose, "-p", self.name, "-f", str(ROOT / "docker-compose.yml"), "up", "-d", "--no-build",
                "--scale", f"worker={workers}"]
        _run_logged(argv, log=self.docker.log, timeout=900, env=self.env)

    def containers(self, service: str | None = None, *, every: bool = False) -> list[str]:
        """Container ids of the project (of one service), running ones unless `every`."""
        args = ["ps", "-q", "--filter", f"label=com.docker.compose.project={self.name}"]
        if service is not None:
            args += ["--filter", f"label=com.docker.compose.service={service}"]
        if every:
            args.append("-a")
        return self.docker.run(*args).stdout.split()

    def inspect(self, container: str) -> dict[str, object]:
        return json.loads(self.docker.run("inspect", container).stdout)[0]  # type: ignore[no-any-return]

    def address(self, container: str) -> str:
        """The container's IP address on the project's network."""
        networks = self.inspect(container)["NetworkSettings"]["Networks"]  # type: ignore[index]
        for network in networks.values():  # type: ignore[attr-defined]
            if network["IPAddress"]:
                return str(network["IPAddress"])
        raise RuntimeError(f"container {container} has no address")

    def network(self) -> str:
        return f"{self.name}_default"

    def main_pid(self, container: str) -> int:
        """The host pid of the process the container runs under its init (the taco_llm process)."""
        init = int(self.docker.run("inspect", container, "--format", "{{.State.Pid}}").stdout)
        children = _run(["ps", "--ppid", str(init), "-o", "pid="], check=False).stdout.split()
        return int(children[0]) if children else init

    def kill(self, container: str) -> None:
        """`docker kill`: the host is gone. Every process gets SIGKILL at once, but the container is reported
        stopped only once the last has exited, and a vLLM process that mapped gigabytes can spend a minute
        and more in the kernel's exit_mmap on a loaded machine (seen here: 90 s): Docker 20.10 then answers
        "did not receive an exit event". The fault is done either way; this waits for the exit."""
        result = self.docker.run("kill", container, check=False)
        if result.returncode != 0:
            wait_for(lambda: not self.running(container), 300, f"container {container} stopping after docker kill "
                     f"({result.stderr.strip()})")

    def running(self, container: str) -> bool:
        return self.docker.run("inspect", container, "--format", "{{.State.Running}}").stdout.strip() == "true"

    def crash(self, container: str) -> None:
        """SIGKILL to the container's main process, as the kernel's OOM killer would: the container exits
        on its own (not stopped by hand), so its restart policy brings it back."""
        os.kill(self.main_pid(container), signal.SIGKILL)

    def restart_count(self, container: str) -> int:
        return int(self.docker.run("inspect", container, "--format", "{{.RestartCount}}").stdout)

    def logs(self, service: str, tail: int = 80) -> str:
        return self.compose("logs", "--no-color", f"--tail={tail}", service, check=False).stdout

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=600, check=False)

    def leftovers(self) -> dict[str, list[str]]:
        """What of the project docker still has: containers, networks and volumes."""
        label = f"label=com.docker.compose.project={self.name}"
        return {
            "containers": self.docker.run("ps", "-aq", "--filter", label).stdout.split(),
            "networks": self.docker.run("network", "ls", "-q", "--filter", label).stdout.split(),
            "volumes": self.docker.run("volume", "ls", "-q", "--filter", label).stdout.split(),
        }


@contextlib.contextmanager
def disconnected(project: ComposeProject, container: str) -> Iterator[None]:
    """A network partition: the container is cut off its network (no connection is refused: packets just
    stop), then reconnected."""
    network = project.network()
    project.docker.run("network", "disconnect", network, container)
    try:
        yield
    finally:
        project.docker.run("network", "connect", network, container, check=False)


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> float:
    """Seconds until `condition` held; raises TimeoutError naming `what`."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(Exception):
            if condition():
                return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(interval)
