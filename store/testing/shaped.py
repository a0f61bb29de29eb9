"""A test cloud behind a shaped link: bandwidth from ``tbf``, a round trip per request, nginx and S3.

:class:`ShapedCloud` builds, for one test or benchmark, what a cloud load depends on: a link of a
given rate and a round trip per request. It creates a network namespace of its own
(``reshard-<pid>-<n>``) joined to the host by a veth pair whose two ends are shaped by the
``tbf`` qdisc (``rate`` each way), and runs inside the namespace, on its ``127.0.0.1``:

* nginx serving :attr:`ShapedCloud.root` (HTTP range reads at page-cache speed),
* moto's S3 server (S3 semantics: multipart uploads, conditional PUT), with connections kept
  alive as S3 keeps them (:mod:`reshard.store.testing.motoserve`),
* the latency relay (:mod:`reshard.store.testing.latency`) in front of both, listening on the
  namespace's end of the veth: every request waits ``rtt`` before it reaches its server, a new
  connection one ``rtt`` more (the TCP handshake).

The client is the calling process itself (and whatever it starts: s3fs's event loop thread,
TensorStore, torch DCP, subprocesses), reaching the servers at the namespace's address over the
veth: tests and benchmarks need no ``ip netns exec`` of their own, and everything they send or
receive crosses the shaped link. Nothing but this veth leads into the namespace; the host's
``lo`` and any namespace or qdisc this class did not create are never touched. ``stop`` (also
called at exit) kills the servers by pid and deletes the veth and the namespace. A process killed
outright (no atexit) takes its servers with it (``PR_SET_PDEATHSIG``); the next cloud started on
the machine deletes the namespace it left (``reshard-<pid>-<n>`` whose pid is gone).

Needs root, ``ip`` and ``tc`` (iproute2), ``nginx`` and ``cheroot`` (``reshard[testing]``);
:func:`unavailable` says what is missing.

Examples
--------
>>> with ShapedCloud(rate_mbit=800, rtt=0.02) as cloud:  # doctest: +SKIP
...     (cloud.root / "a.bin").write_bytes(b"x" * 1000)       # served as cloud.http_url + "/a.bin"
...     bucket = cloud.make_bucket()
...     fs = s3fs.S3FileSystem(**cloud.storage_options())
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import importlib.util
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from . import chain, latency, motoserve
from .service import REGION, LocalService, s3_request, s3_storage_options

__all__ = ["ShapedCloud", "ShapedCloudUnavailable", "unavailable"]

_COUNTER = itertools.count()
_LOCK = threading.Lock()
_NGINX_PORT, _MOTO_PORT, _HTTP_PORT, _S3_PORT = 8080, 5000, 80, 9000


class ShapedCloudUnavailable(RuntimeError):
    """This machine cannot build the shaped cloud (no root, no namespaces, no nginx...)."""


def unavailable() -> str | None:
    """Return why :class:`ShapedCloud` cannot start here, or ``None`` when it can (cheap checks only)."""
    if sys.platform != "linux":
        return "the shaped cloud needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the shaped cloud needs root (network namespaces, tc)"
    for tool in ("ip", "tc", "nginx"):
        if _which(tool) is None:
            hint = " (apt-get install nginx-light)" if tool == "nginx" else " (iproute2)"
            return f"the shaped cloud needs `{tool}` on PATH{hint}"
    if importlib.util.find_spec("cheroot") is None:
        return "the shaped cloud's S3 server needs cheroot (pip install 'reshard[testing]')"
    return None


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin:/bin")


def _die_with_parent() -> None:
    """In a server's child process before exec: be killed when the process that started it dies (no atexit)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _sweep_orphans() -> None:
    """Delete what a killed process left of its clouds: namespaces ``reshard-<pid>-<n>`` whose pid is gone.

    Only this class makes such names; their servers died with their owner (``PR_SET_PDEATHSIG``), nginx's
    workers are killed here, by pid, then the namespace (its veth goes with it).
    """
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "reshard" or not parts[1].isdigit() or not parts[2].isdigit():
            continue
        if os.path.exists(f"/proc/{parts[1]}"):
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout
        for pid in pids.split():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", f"rs{int(parts[1]):x}x{parts[2]}h"], capture_output=True, timeout=30)
    for folder in Path(tempfile.gettempdir()).glob("reshard-cloud-*-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(folder, ignore_errors=True)


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise ShapedCloudUnavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")


class ShapedCloud(LocalService):
    """nginx and an S3 server in a network namespace of their own, behind a shaped link.

    Parameters
    ----------
    rate_mbit : float
        The link's rate in Mbit/s, each way (``tbf`` on both ends of the veth).
    rtt : float
        Seconds every request waits before it reaches its server (a new connection one more).
    root : path, optional
        Folder nginx serves; by default a fresh temporary one, deleted at :meth:`stop`.
    conn_mbit : float, optional
        Cap on what one connection downloads, in Mbit/s (object stores give each connection a
        fraction of the link); ``None``: one connection can fill the link.

    Attributes
    ----------
    namespace : str
        Name of the network namespace (``reshard-<pid>-<n>``).
    address : str
        The namespace's end of the veth, where the servers listen.
    """

    def __init__(self, rate_mbit: float = 1000.0, rtt: float = 0.02,
                 root: str | os.PathLike[str] | None = None, conn_mbit: float | None = None) -> None:
        if rate_mbit <= 0 or rtt < 0 or (conn_mbit is not None and conn_mbit <= 0):
            raise ValueError(f"ShapedCloud needs rate_mbit > 0, rtt >= 0 and conn_mbit > 0 or None, got "
                             f"{rate_mbit}, {rtt} and {conn_mbit}")
        self.conn_mbit = conn_mbit
        self.rate_mbit = float(rate_mbit)
        self.rtt = float(rtt)
        self._given_root = Path(root) if root is not None else None
        self._tmp: str | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._links: list[str] = []
        self.namespace = ""
        self.address = ""
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> ShapedCloud:
        """Build the namespace, link and servers (idempotent); return ``self``.

        Raises
        ------
        ShapedCloudUnavailable
            When :func:`unavailable` gives a reason, or a step (``ip netns add``, ``tc``, a
            server) fails; nothing is left behind.
        """
        if self._started:
            return self
        reason = unavailable()
        if reason:
            raise ShapedCloudUnavailable(reason)
        _sweep_orphans()
        self._started = True
        atexit.register(self.stop)
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self) -> None:
        with _LOCK:
            n = next(_COUNTER)
        pid = os.getpid()
        self._tmp = tempfile.mkdtemp(prefix=f"reshard-cloud-{pid}-")
        self.root = self._given_root or Path(self._tmp) / "www"
        self.root.mkdir(parents=True, exist_ok=True)
        self.namespace = f"reshard-{pid}-{n}"
        host_if, ns_if = f"rs{pid:x}x{n}h", f"rs{pid:x}x{n}n"
        _run("ip", "netns", "add", self.namespace)
        self._links.append(host_if)
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _run("ip", "link", "set", ns_if, "netns", self.namespace)
        self.address = self._pick_subnet(host_if, ns_if)
        ns = ("ip", "netns", "exec", self.namespace)
        _run(*ns, "ip", "link", "set", "lo", "up")
        _run(*ns, "ip", "link", "set", ns_if, "up")
        _run("ip", "link", "set", host_if, "up")
        # Each direction is shaped where it leaves: downloads at the namespace's end, uploads at the host's.
        rate = f"{self.rate_mbit:g}mbit"
        burst = str(max(64 << 10, int(self.rate_mbit * 1e6 / 8 * 0.002)))  # 2 ms of the rate, >= a GSO segment
        tbf = ("qdisc", "add", "dev")
        shape = ("root", "tbf", "rate", rate, "burst", burst, "latency", "100ms")
        _run("tc", *tbf, host_if, *shape)
        _run(*ns, "tc", *tbf, ns_if, *shape)
        self._start_servers()

    def _pick_subnet(self, host_if: str, ns_if: str) -> str:
        """Give the veth a /30 of 10.254.0.0/16 that no interface here uses yet; return the namespace's address."""
        taken = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
        start = (os.getpid() * 7 + len(self._links)) % 16384
        for i in range(16384):
            k = (start + i) % 16384
            host_ip, ns_ip = f"10.254.{k >> 6}.{((k & 63) << 2) + 1}", f"10.254.{k >> 6}.{((k & 63) << 2) + 2}"
            if f" {host_ip}/" in taken or f" {ns_ip}/" in taken:
                continue
            done = subprocess.run(["ip", "addr", "add", f"{host_ip}/30", "dev", host_if],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode:
                continue
            _run("ip", "netns", "exec", self.namespace, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
            return ns_ip
        raise ShapedCloudUnavailable("no free /30 in 10.254.0.0/16 for the shaped cloud's veth")

    def _spawn(self, name: str, *cmd: str) -> subprocess.Popen[bytes]:
        assert self._tmp is not None
        log = open(Path(self._tmp) / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace, *cmd], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        self._procs.append(proc)
        return proc

    def _start_servers(self) -> None:
        assert self._tmp is not None
        tmp = Path(self._tmp)
        conf = tmp / "nginx.conf"
        conf.write_text(_nginx_conf(tmp, self.root))
        self._spawn("nginx", _which("nginx") or "nginx", "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "error.log"))
        self._spawn("moto", sys.executable, motoserve.__file__, "-H", "127.0.0.1", "-p", str(_MOTO_PORT))
        ready = tmp / "latency.ready"
        self._spawn("latency", sys.executable, latency.__file__, "--rtt", repr(self.rtt),
                    "--route", f"{self.address}:{_HTTP_PORT}=127.0.0.1:{_NGINX_PORT}",
                    "--route", f"{self.address}:{_S3_PORT}=127.0.0.1:{_MOTO_PORT}", "--ready", str(ready),
                    "--conn-mbit", repr(self.conn_mbit or 0.0), "--log", str(tmp / "requests.tsv"))
        deadline = time.monotonic() + 60
        (self.root / ".reshard-cloud-probe").write_bytes(b"ok")
        waiting = {"nginx": self._probe_http, "moto": self._probe_s3}
        while waiting:
            for proc in self._procs:
                if proc.poll() is not None:
                    name = str(proc.args[4] if isinstance(proc.args, list) else proc.args)
                    raise ShapedCloudUnavailable(f"a shaped-cloud server exited ({name}, rc {proc.returncode}): "
                                                 f"{self._logs()}")
            if ready.exists():
                for name, probe in list(waiting.items()):
                    if probe():
                        del waiting[name]
            if time.monotonic() > deadline:
                raise ShapedCloudUnavailable(f"shaped cloud not ready in 60 s ({', '.join(waiting)}): {self._logs()}")
            time.sleep(0.05)
        (self.root / ".reshard-cloud-probe").unlink()

    def requests(self, since: float = 0.0, until: float = float("inf")) -> list[chain.Relayed]:
        """The requests the relay passed on in ``[since, until)`` (``time.monotonic()``), in order sent;
        :func:`reshard.store.testing.chain.depths` counts their round trips one after another."""
        assert self._tmp is not None
        return chain.read_log(Path(self._tmp) / "requests.tsv", since, until)

    def _logs(self) -> str:
        assert self._tmp is not None
        out = []
        for log in sorted(Path(self._tmp).glob("*.log")):
            text = log.read_text(errors="replace").strip()
            if text:
                out.append(f"[{log.name}] {text[-800:]}")
        return " ".join(out) or "(no output)"

    def _probe_http(self) -> bool:
        try:
            return self.get(f"/{'.reshard-cloud-probe'}")[0] == 200
        except OSError:
            return False

    def _probe_s3(self) -> bool:
        try:
            s3_request(self.s3_endpoint, "GET", "/", timeout=5)
            return True
        except (OSError, RuntimeError):
            return False

    def stop(self) -> None:
        """Kill the servers (by pid), delete the veth and the namespace, remove temporary files (idempotent)."""
        if not self._started:
            return
        self._started = False
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        self._links = []
        if self.namespace:
            subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, timeout=30)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        atexit.unregister(self.stop)

    # -- endpoints ---------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """``http://ADDRESS`` serving :attr:`root` (read-only, range reads)."""
        return f"http://{self.address}:{_HTTP_PORT}"

    @property
    def s3_endpoint(self) -> str:
        """``http://ADDRESS:PORT`` of the S3 server."""
        return f"http://{self.address}:{_S3_PORT}"

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint (as :attr:`LocalS3Server.endpoint_url`)."""
        return self.s3_endpoint

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs storage options reaching the shaped S3 server; see :func:`s3_storage_options`."""
        return s3_storage_options(self.s3_endpoint, **extra)

    def client(self) -> Any:
        """A fresh ``boto3`` S3 client reaching the shaped S3 server."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.s3_endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name=REGION,
                            config=Config(s3={"addressing_style": "path"}))

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (``reshard-test-<random>`` if no name is given); return its name."""
        name = name or f"reshard-test-{uuid.uuid4().hex[:12]}"
        s3_request(self.s3_endpoint, "PUT", f"/{name}")
        return name

    def get(self, path: str, headers: dict[str, str] | None = None,
            conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
        """One HTTP GET of ``path`` from nginx over the link (on ``conn`` if given); return status and body."""
        own = conn is None
        c = conn or http.client.HTTPConnection(self.address, _HTTP_PORT, timeout=30)
        try:
            c.request("GET", path, headers=headers or {})
            resp = c.getresponse()
            return resp.status, resp.read()
        finally:
            if own:
                c.close()


def _nginx_conf(tmp: Path, root: Path) -> str:
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}daemon off;
master_process on;
worker_processes 2;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 300s;
    keepalive_requests 100000;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ }}
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{_NGINX_PORT};
        root {root};
        location / {{ }}
    }}
}}
"""
