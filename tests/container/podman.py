"""Podman as the container tests run it (ASSETS.md, "A container engine"): runc, a containers.conf and a storage
of their own, a Debian base image made here from the machine's apt mirror, and the state podman leaves on the host
removed afterwards."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("podman", "buildah", "mmdebstrap", "runc")
SUITE = "bookworm"  # Debian 12: its python3 is 3.11, as the official python:3.11-slim image's
BASE_IMAGE = f"localhost/layerserve-test-base:{SUITE}"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# What podman writes outside its own storage (ASSETS.md): removed after the tests where they appeared.
HOST_STATE = (Path("/var/lib/containers/cache"), Path("/run/containers/networks"))
NETNS = Path("/run/netns")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")  # netavark turns it on for a build's RUN steps
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def missing_tools() -> list[str]:
    """The programs the container tests need that are not installed (scripts/install --dev installs them as root)."""
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def build_inputs_digest() -> str:
    """A digest of what the image's dependency layer is made of (about 1.3 GB): a change starts a storage of its own.
    The build's own layer cache follows every other change (the Containerfile's steps, the source)."""
    digest = hashlib.sha256()
    for name in ("constraints.txt", "pyproject.toml"):
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()[:16]


def remove_stale_storages(current: Path) -> None:
    """Remove the storages of `current`'s siblings made for other build inputs that no test run is using."""
    for stale in current.parent.glob("layerserve-container-*"):
        if stale == current:
            continue
        with (stale / "in-use.lock").open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(stale, ignore_errors=True)


def debian_mirror(sources: Path = Path("/etc/apt")) -> str:
    """The machine's Debian mirror, as its apt sources name it (deb822 `.sources` files or `sources.list`).

    Raises:
        AssertionError: no apt source offers the suite's main component.
    """
    for path in sorted((sources / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            offers = {key: fields.get(key, "").split() for key in ("Types", "Suites", "Components")}
            if "deb" in offers["Types"] and SUITE in offers["Suites"] and "main" in offers["Components"]:
                return fields["URIs"].split()[0]
    lists = [sources / "sources.list", *sorted((sources / "sources.list.d").glob("*.list"))]
    for path in (p for p in lists if p.exists()):
        for line in path.read_text().splitlines():
            match = re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)", line.strip())
            if match and match[2] == SUITE and "main" in match[3].split():
                return match[1]
    raise AssertionError(f"no apt source offers Debian {SUITE} main: the base image cannot be made")


class Podman:
    """podman with a configuration and a storage under `root` (kept between runs: its layers are the cache)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._in_use = (root / "in-use.lock").open("w")  # shared while a test run uses this storage
        try:
            fcntl.flock(self._in_use, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._alone = True
        except BlockingIOError:
            self._alone = False
        fcntl.flock(self._in_use, fcntl.LOCK_SH)
        (root / "containers.conf").write_text(CONTAINERS_CONF)
        storage = f'[storage]\ndriver = "overlay"\nrunroot = "{root}/run"\ngraphroot = "{root}/graph"\n'
        (root / "storage.conf").write_text(storage)
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(root / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(root / "storage.conf"),
        }

    def __call__(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Run `podman ARGS`; its output as text (an error names the command and what podman said)."""
        result = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}")
        return result

    def has_image(self, name: str) -> bool:
        """Whether the storage holds an image of this name."""
        result = self("image", "exists", name, check=False)
        assert result.returncode in {0, 1}, f"podman image exists {name} exited {result.returncode}: {result.stderr}"
        return result.returncode == 0

    def make_base_image(self, work: Path) -> None:
        """A minimal Debian with python3 and venv, from the machine's mirror (mmdebstrap), imported as BASE_IMAGE."""
        if self.has_image(BASE_IMAGE):
            return
        rootfs = work / "rootfs.tar"
        command = ["mmdebstrap", "--quiet", "--variant=minbase", "--include=python3,python3-venv", SUITE, str(rootfs)]
        subprocess.run([*command, f"deb {debian_mirror()} {SUITE} main"], check=True, timeout=900)
        self("import", str(rootfs), BASE_IMAGE, timeout_s=300)
        rootfs.unlink()

    def build(self, tag: str, log: Path) -> None:
        """Build the repository's Containerfile on BASE_IMAGE, pip trusting the host's CA bundle at build time only."""
        if self._alone:  # a build killed midway (a timeout) leaves its working containers
            subprocess.run(["buildah", "rm", "--all"], env=self.env, capture_output=True, check=False, timeout=300)
        before = self("image", "inspect", "--format", "{{.Id}}", tag, check=False).stdout.strip()
        args = ["build", "--pull=never", "--format", "docker", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
        if HOST_CA_BUNDLE.exists():  # HTTPS re-signed by a local CA: mounted for pip, never copied into the image
            args += ["-v", f"{HOST_CA_BUNDLE}:/run/pip-ca.crt:ro", "--build-arg", "PIP_CERT=/run/pip-ca.crt"]
        result = self(*args, "-t", tag, "-f", str(ROOT / "Containerfile"), str(ROOT), check=False, timeout_s=1800)
        log.write_text(result.stdout + result.stderr)
        assert result.returncode == 0, f"the image build failed:\n{(result.stdout + result.stderr)[-6000:]}"
        if before and before != self("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip():
            self("rmi", before, check=False)  # the image of an older source: 1.3 GB a change

    def close(self) -> None:
        """Let stale_storages() remove this storage once its key is no longer the current one."""
        self._in_use.close()

    def remove(self, name: str) -> None:
        """Remove a container by its name (stopped first, 5 s grace); nothing if there is none."""
        self("rm", "--force", "--volumes", "--time", "5", name, check=False)


def _iptables(table: str, *args: str) -> str:
    return subprocess.run(["iptables", "-t", table, *args], capture_output=True, text=True, check=False).stdout


def _netavark_chains() -> set[tuple[str, str]]:
    if shutil.which("iptables") is None:
        return set()
    found = set()
    for table in ("nat", "filter"):
        found |= {(table, chain) for chain in re.findall(r"^-N (NETAVARK\S*)", _iptables(table, "-S"), re.M)}
    return found


def _remove_chains(chains: set[tuple[str, str]]) -> None:
    """Netavark's chains: the rules that jump to them, then their rules, then the chains."""
    for table in {table for table, _ in chains}:
        names = {chain for t, chain in chains if t == table}
        for rule in _iptables(table, "-S").splitlines():
            words = shlex.split(rule)
            jumps_to = words[words.index("-j") + 1] if "-j" in words else ""
            if words[:1] == ["-A"] and words[1] not in names and jumps_to in names:
                _iptables(table, "-D", *words[1:])
        for chain in names:
            _iptables(table, "-F", chain)
        for chain in names:
            _iptables(table, "-X", chain)


def _namespaces() -> set[str]:
    return {path.name for path in NETNS.iterdir()} if NETNS.is_dir() else set()


@contextmanager
def host_state_restored() -> Iterator[None]:
    """Remove what podman leaves on the host outside its storage (network state, netns, netavark's chains) that
    was not there before, and set IP forwarding back."""
    existed = {path: path.exists() for path in (*HOST_STATE, NETNS)}
    forwarding = IP_FORWARD.read_text()
    namespaces = _namespaces()
    chains = _netavark_chains()
    try:
        yield
    finally:
        for name in _namespaces() - namespaces:
            subprocess.run(["umount", str(NETNS / name)], capture_output=True, check=False)
            (NETNS / name).unlink(missing_ok=True)
        for path, was_there in existed.items():
            if not was_there:
                subprocess.run(["umount", str(path)], capture_output=True, check=False)  # podman bind-mounts NETNS
                shutil.rmtree(path, ignore_errors=True)
        _remove_chains(_netavark_chains() - chains)
        if IP_FORWARD.read_text() != forwarding:
            IP_FORWARD.write_text(forwarding)
