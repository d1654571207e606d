"""An etcd cluster on loopback for tests: ``members`` etcd processes on free ports in a
directory of their own, optionally behind TLS with client certificates (a CA made for it)
and with etcd's authentication on. A member can be killed (:meth:`EtcdCluster.kill`).
Needs Debian's ``etcd-server`` (the ``etcd`` binary); :func:`unavailable_reason` says
when it is missing. Every wait is bounded.
"""

from __future__ import annotations

import base64
import datetime
import http.client
import ipaddress
import json
import shutil
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.cluster.store import StoreAccess

from .localcluster import free_port

START_TIMEOUT_S = 30.0


def unavailable_reason() -> str | None:
    if shutil.which("etcd") is None:
        return "no etcd binary: install Debian's etcd-server (apt-get install etcd-server)"
    return None


@dataclass(frozen=True)
class Tls:
    """A CA, a certificate for the members (127.0.0.1, server and client use) and one
    for kvferry's client (no CommonName: etcd's gateway refuses a client certificate with
    one, as its name would not be taken as the user's), as files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls(directory: Path) -> Tls:
    """A fresh CA and the certificates it signs, in ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvferry test etcd CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def issue(name: str) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)] if name else [])
            )
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        return (
            cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )

    directory.mkdir(parents=True, exist_ok=True)
    paths = Tls(
        *(directory / n for n in ("ca.pem", "server.pem", "server.key", "kv.pem", "kv.key"))
    )
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for (cert_path, key_path), name in (
        ((paths.server_cert, paths.server_key), "etcd member"),
        # no CommonName: etcd's gateway refuses a client certificate that has one
        ((paths.client_cert, paths.client_key), ""),
    ):
        cert, key = issue(name)
        cert_path.write_bytes(cert)
        key_path.write_bytes(key)
        key_path.chmod(0o600)
    return paths


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    proc: subprocess.Popen | None = None


@dataclass
class EtcdCluster:
    """``members`` on loopback; ``url`` is the ``--store`` value that names them all."""

    directory: Path
    members: list[Member]
    tls: Tls | None = None
    user: str | None = None
    password_file: Path | None = None
    prefix: str = "kvferry"
    logs: list[Path] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)
        return f"etcd://{hosts}/{self.prefix}"

    def access(self) -> StoreAccess:
        return StoreAccess(
            ca_file=str(self.tls.ca) if self.tls else None,
            cert_file=str(self.tls.client_cert) if self.tls else None,
            key_file=str(self.tls.client_key) if self.tls else None,
            user=self.user,
            password_file=str(self.password_file) if self.password_file else None,
        )

    def serve_args(self) -> list[str]:
        """The ``kvferry serve`` options that reach this etcd."""
        pairs = zip(
            ("--store-ca", "--store-cert", "--store-key", "--store-user", "--store-password-file"),
            (
                self.tls and self.tls.ca,
                self.tls and self.tls.client_cert,
                self.tls and self.tls.client_key,
                self.user,
                self.password_file,
            ),
            strict=True,
        )
        return [part for opt, value in pairs if value for part in (opt, str(value))]

    def leader(self) -> int:
        """The index of the member that leads now (asked of the first one that answers)."""
        for i, m in enumerate(self.members):
            if m.proc is None or m.proc.poll() is not None:
                continue
            status = self.call(i, "/v3/maintenance/status", {})
            ids = [
                self.call(j, "/v3/maintenance/status", {})["header"]["member_id"]
                if n.proc is not None and n.proc.poll() is None
                else None
                for j, n in enumerate(self.members)
            ]
            return ids.index(status["leader"])
        raise RuntimeError("no etcd member is running")

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (as a crash would)."""
        proc = self.members[index].proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        """Every member killed: a test's etcd keeps nothing, and a member that lost its
        peers takes seconds to stop gracefully."""
        for i in range(len(self.members)):
            self.kill(i)

    # ------------------------------------------------------------------ admin, for set-up
    def _client_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        ctx = ssl.create_default_context(cafile=str(self.tls.ca))
        ctx.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return ctx

    def call(self, index: int, path: str, body: dict, token: str | None = None) -> dict:
        """One v3 gateway call to member ``index``; RuntimeError with etcd's answer
        unless it is 200."""
        port = self.members[index].client_port
        conn: http.client.HTTPConnection
        ctx = self._client_context()
        if ctx is not None:
            conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=ctx)
        else:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            headers = {"Content-Type": "application/json"}
            if token:
                headers["Authorization"] = token
            conn.request("POST", path, json.dumps(body), headers)
            resp = conn.getresponse()
            reply = json.loads(resp.read() or b"{}")
            if resp.status != 200:
                raise RuntimeError(f"etcd {path}: HTTP {resp.status} {reply}")
            return reply
        finally:
            conn.close()

    def enable_auth(self, user: str, password: str) -> None:
        """etcd's authentication on: ``root`` (etcd needs it), and ``user`` with read and
        write on this cluster's prefix only; the password goes to a file of its own."""
        b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
        prefix = (self.prefix + "/").encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        for name, pw in (("root", secret_of(password)), (user, password)):
            self.call(0, "/v3/auth/user/add", {"name": name, "password": pw})
        self.call(0, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        self.call(0, "/v3/auth/role/add", {"name": "kvferry"})
        self.call(
            0,
            "/v3/auth/role/grant",
            {
                "name": "kvferry",
                "perm": {"permType": "READWRITE", "key": b64(prefix), "range_end": b64(end)},
            },
        )
        self.call(0, "/v3/auth/user/grant", {"user": user, "role": "kvferry"})
        self.call(0, "/v3/auth/enable", {})
        self.user = user
        self.password_file = self.directory / "password"
        self.password_file.write_text(password + "\n")
        self.password_file.chmod(0o600)


def secret_of(text: str) -> str:
    return "root-" + text


def start(
    directory: Path,
    members: int = 3,
    tls: bool = False,
    prefix: str = "kvferry",
    timeout_s: float = START_TIMEOUT_S,
) -> EtcdCluster:
    """``members`` etcd processes forming one cluster on loopback, each with its data and
    log in ``directory``; waits until every member answers. Stops them on failure."""
    directory.mkdir(parents=True, exist_ok=True)
    cluster = EtcdCluster(
        directory,
        [Member(f"m{i}", free_port(), free_port()) for i in range(members)],
        tls=make_tls(directory / "tls") if tls else None,
        prefix=prefix,
    )
    scheme = "https" if tls else "http"
    initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in cluster.members)
    for m in cluster.members:
        client = f"{scheme}://127.0.0.1:{m.client_port}"
        cmd = [
            "etcd",
            "--name",
            m.name,
            "--data-dir",
            str(directory / m.name),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            f"http://127.0.0.1:{m.peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{m.peer_port}",
            "--initial-cluster",
            initial,
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            directory.name,
        ]
        if cluster.tls is not None:
            cmd += [
                "--cert-file",
                str(cluster.tls.server_cert),
                "--key-file",
                str(cluster.tls.server_key),
                "--trusted-ca-file",
                str(cluster.tls.ca),
                "--client-cert-auth",
            ]
        log = directory / f"{m.name}.log"
        cluster.logs.append(log)
        m.proc = subprocess.Popen(
            cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    try:
        for i, m in enumerate(cluster.members):
            while True:
                assert m.proc is not None
                if m.proc.poll() is not None:
                    tail = cluster.logs[i].read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"etcd member {m.name} exited:\n{tail}")
                try:
                    cluster.call(i, "/v3/kv/range", {"key": base64.b64encode(b"x").decode()})
                    break
                except (OSError, RuntimeError, http.client.HTTPException):
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"etcd member {m.name} not answering within {timeout_s:.0f} s"
                        ) from None
                    time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster
