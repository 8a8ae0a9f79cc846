"""EtcdStore over https with client certificates and with user/password auth, and the errors
a user sees when the certificate, the credentials, the protocol or the endpoint is wrong."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from rdzv.errors import StoreAuthenticationError, StoreConnectionError
from rdzv.etcd import EtcdClient, EtcdOptions, EtcdTLSFiles, LocalEtcd
from rdzv.etcd._local import free_ports
from rdzv.store import EtcdStore

PASSWORD = "rdzv-test-password"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=rdzv test CA", cwd=d)  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        openssl(
            "req",
            *ec,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return {
        f: str(d / f) for f in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    }


@pytest.fixture(scope="module")
def tls_etcd(etcd_binary: str, pki: dict[str, str]) -> Iterator[LocalEtcd]:
    tls = EtcdTLSFiles(cert=pki["server.pem"], key=pki["server.key"], ca=pki["ca.pem"])
    with LocalEtcd(binary=etcd_binary, tls=tls) as etcd:
        yield etcd


def test_https_with_client_certificate(tls_etcd: LocalEtcd, pki: dict[str, str]) -> None:
    with EtcdStore(tls_etcd.url, ca_cert=pki["ca.pem"], ssl_cert=pki["client.pem"],
                   ssl_cert_key=pki["client.key"], prefix="tls/") as store:  # fmt: skip
        store.set("k", "v", ephemeral=True)
        assert store.get("k") == b"v"
        assert store.watch("k", 0, 5) > 0


def test_https_without_client_certificate_fails_clearly(
    tls_etcd: LocalEtcd, pki: dict[str, str]
) -> None:
    with pytest.raises(StoreConnectionError, match=f"TLS with etcd at {tls_etcd.endpoint}"):
        EtcdStore(tls_etcd.endpoint, protocol="https", ca_cert=pki["ca.pem"], retry_timeout=2)


def test_http_to_https_server_says_use_https(tls_etcd: LocalEtcd) -> None:
    with pytest.raises(StoreConnectionError, match="protocol=https"):
        EtcdStore(tls_etcd.endpoint, retry_timeout=2)


@pytest.fixture(scope="module")
def auth_etcd(etcd_binary: str) -> Iterator[LocalEtcd]:
    """An etcd with auth enabled: user root (all keys) and user job (keys under job/ only).

    Tokens live 2 s, so the tests also cover re-authentication after expiry."""
    with LocalEtcd(
        binary=etcd_binary, extra_args=["--auth-token", "simple", "--auth-token-ttl", "2"]
    ) as etcd:
        admin = EtcdClient(EtcdOptions((etcd.endpoint,)))
        for path, body in [
            ("auth/user/add", {"name": "root", "password": PASSWORD}),
            ("auth/role/add", {"name": "root"}),
            ("auth/user/grant", {"user": "root", "role": "root"}),
            ("auth/user/add", {"name": "job", "password": PASSWORD}),
            ("auth/role/add", {"name": "job"}),
            ("auth/role/grant", {"name": "job", "perm": {"permType": "READWRITE",
                                 "key": "am9iLw==", "range_end": "am9iMA=="}}),  # job/ .. job0
            ("auth/user/grant", {"user": "job", "role": "job"}),
            ("auth/enable", {}),
        ]:  # fmt: skip
            admin.call(path, body)
        admin.close()
        yield etcd


def test_user_password_auth_and_token_renewal(auth_etcd: LocalEtcd) -> None:
    with EtcdStore(auth_etcd.endpoint, user="root", password=PASSWORD, prefix="a/") as store:
        store.set("k", "v", ephemeral=True)
        time.sleep(3)  # the token expires; the store authenticates again
        assert store.add("n", 2) == 2
        assert store.get("k") == b"v"
        store.delete_key("k")
        assert store.revision("k") > 0


def test_user_limited_to_a_prefix(auth_etcd: LocalEtcd) -> None:
    with EtcdStore(auth_etcd.endpoint, user="job", password=PASSWORD, prefix="job/") as store:
        store.set("d/k", "v")
        before = store.revision("d/")
        store.delete_key("d/k")
        # without the right to watch all of etcd, revision() is an upper bound, never below
        assert store.revision("d/") > before
        assert store.watch("d/", 0, 5) > 0
    with pytest.raises(StoreAuthenticationError, match="permission denied"):
        EtcdStore(auth_etcd.endpoint, user="job", password=PASSWORD, prefix="other/")


def test_wrong_or_missing_credentials(auth_etcd: LocalEtcd) -> None:
    with pytest.raises(StoreAuthenticationError, match="user and password"):
        EtcdStore(auth_etcd.endpoint, user="root", password="wrong")
    with pytest.raises(StoreAuthenticationError):
        EtcdStore(auth_etcd.endpoint)


def test_unreachable_endpoints_name_each_endpoint() -> None:
    ports = free_ports(2)
    endpoints = [f"127.0.0.1:{port}" for port in ports]
    started = time.monotonic()
    with pytest.raises(StoreConnectionError) as info:
        EtcdStore(endpoints, retry_timeout=1)
    assert time.monotonic() - started < 30
    for endpoint in endpoints:
        assert endpoint in str(info.value)
