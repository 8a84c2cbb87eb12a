"""Private servers for fault-injection tests.

Fault tests crash databases, kill caches and skew clocks. Doing that to the
shared services on this machine (PostgreSQL :5432, MariaDB :3306, Redis :6379)
would break every other test run, so each context manager here starts its own
server on a free port, in its own temporary directory, and stops it and
deletes the directory in a ``finally``, also when the test fails.

Every start waits, with a bounded timeout, until the server answers, and
raises ``ServerError`` with the tail of the server's log if it does not. A
missing binary skips the test with the package to install.

PostgreSQL and pgbouncer refuse to run as root, so under root they run as
the ``postgres`` user (``Popen(user=...)`` rather than ``runuser``, so the
process we hold is the server itself and a signal reaches it directly).
"""

from __future__ import annotations

import contextlib
import glob
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from base64 import b64encode
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
# Ports of the shared services: never handed out, never touched.
SHARED_PORTS = frozenset({5432, 3306, 6379})
START_TIMEOUT = 60.0
USERS: tuple[tuple[str, str], ...] = (("alice", "pw"), ("bob", "pw"))


class ServerError(RuntimeError):
    """A private server did not come up (or down); the message ends with its log."""


# ------------------------------------------------------------------ helpers


def free_port() -> int:
    """A port nobody listens on now. The kernel picks it, so two calls in a row
    do not collide; a shared service's port is never returned."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port: int = sock.getsockname()[1]
        if port not in SHARED_PORTS:
            return port


def require(binary: str, install_hint: str) -> str:
    """The binary's path, or skip the test saying what to install."""
    path = shutil.which(binary) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{binary}", os.X_OK)), None
    )
    if path is None:
        pytest.skip(f"{binary} not found: {install_hint}")
    return path


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_bytes()[-chars:].decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _launch(
    name: str,
    running: subprocess.Popen[bytes] | None,
    command: list[str],
    cwd: Path,
    **options: Any,
) -> subprocess.Popen[bytes]:
    """Start a server in a session of its own, quiet (it logs to its file),
    refusing a second copy of one still running."""
    if running is not None and running.poll() is None:
        raise ServerError(f"{name} is already running")
    return subprocess.Popen(
        command, cwd=cwd, env=_plain_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True, **options,
    )  # fmt: skip


def _wait_until(
    ready: Callable[[], bool],
    what: str,
    log: Path,
    process: subprocess.Popen[bytes] | None = None,
    timeout: float = START_TIMEOUT,
) -> None:
    """Poll ``ready`` until true; fail early if ``process`` exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServerError(f"{what} exited with {process.returncode}:\n{log_tail(log)}")
        if ready():
            return
        time.sleep(0.05)
    raise ServerError(f"{what} did not answer within {timeout:.0f} s:\n{log_tail(log)}")


def _as_postgres() -> dict[str, Any]:
    """Popen arguments that drop root to ``postgres`` (nothing when not root)."""
    if os.geteuid() != 0:
        return {}
    return {"user": "postgres", "group": "postgres", "extra_groups": []}


def _chown_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def _plain_env() -> dict[str, str]:
    """A server's environment: no preload, no faked clock, no test settings."""
    return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LC_ALL": "C.UTF-8"}


def _run(command: Sequence[str], log: Path, what: str, **popen: Any) -> None:
    """Run a setup command, appending its output to ``log``. Output goes to a
    file, never a pipe: a daemon it forks would hold a pipe open forever."""
    with log.open("ab") as out:
        done = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, env=popen.pop("env", _plain_env()),
            timeout=popen.pop("timeout", START_TIMEOUT), check=False, **popen,
        )  # fmt: skip
    if done.returncode != 0:
        raise ServerError(f"{what} failed ({done.returncode}):\n{log_tail(log)}")


def _stop_process(process: subprocess.Popen[bytes] | None, grace: float = 20.0) -> None:
    """SIGTERM, then SIGKILL to the whole session if it does not exit in ``grace``."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _kill_process(process)


def _kill_process(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL a server started with ``start_new_session``, and its children."""
    if process is None or process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.wait(timeout=30)


@contextlib.contextmanager
def _workdir(prefix: str, for_postgres: bool = False) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"idem-{prefix}-"))
    try:
        if for_postgres:
            _chown_postgres(path)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------- PostgreSQL


def _postgres_bindir() -> Path:
    """The newest /usr/lib/postgresql/<version>/bin holding initdb and pg_ctl."""
    found = [
        Path(p).parent
        for p in glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")
        if os.access(Path(p).parent / "initdb", os.X_OK)
    ]
    if not found:
        pytest.skip("PostgreSQL server binaries not found: apt-get install postgresql")
    return max(found, key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.name)] or [0])


class PrivatePostgres:
    """A throwaway PostgreSQL cluster: trust auth, 127.0.0.1 only."""

    host = HOST

    def __init__(self, bindir: Path, workdir: Path, port: int, dbname: str) -> None:
        self.bindir, self.workdir, self.port, self.dbname = bindir, workdir, port, dbname
        self.user = "postgres"
        self.datadir = workdir / "data"
        self.log = workdir / "postgres.log"
        self.ctl_log = workdir / "ctl.log"

    def settings_env(self) -> dict[str, str]:
        """IDEMPOTENCY_TEST_DB* variables pointing tests/settings.py here."""
        return {
            "IDEMPOTENCY_TEST_DB": "postgres",
            "IDEMPOTENCY_TEST_DB_HOST": self.host,
            "IDEMPOTENCY_TEST_DB_PORT": str(self.port),
            "IDEMPOTENCY_TEST_DB_USER": self.user,
            "IDEMPOTENCY_TEST_DB_PASSWORD": "",
            "IDEMPOTENCY_TEST_DB_NAME": self.dbname,
        }

    def conninfo(self, dbname: str | None = None) -> str:
        """A libpq connection string (for psycopg.connect)."""
        return (
            f"host={self.host} port={self.port} user={self.user} "
            f"dbname={dbname or self.dbname} connect_timeout=5"
        )

    def _ctl(self, *args: str, timeout: float = START_TIMEOUT) -> None:
        command = [str(self.bindir / "pg_ctl"), "-D", str(self.datadir), *args]
        _run(
            command, self.ctl_log, f"pg_ctl {args[-1]}", cwd=self.workdir,
            timeout=timeout + 10, **_as_postgres(),
        )  # fmt: skip

    def init(self) -> None:
        # --no-sync: the cluster is fresh and the machine does not crash under
        # us; fsync stays on for the server itself, so commits are durable.
        initdb = [
            str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", self.user,
            "-A", "trust", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync",
        ]  # fmt: skip
        _run(initdb, self.ctl_log, "initdb", cwd=self.workdir, **_as_postgres())
        with (self.datadir / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\n# tests/servers.py\nlisten_addresses = '{HOST}'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.workdir}'\nmax_connections = 200\n"
                "shared_buffers = 32MB\nfsync = on\n"
            )

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start (after a crash: recover) and wait until it accepts connections."""
        try:
            self._ctl("-l", str(self.log), "-w", "-t", str(int(timeout)), "start", timeout=timeout)
        except ServerError as exc:
            raise ServerError(f"{exc}\n--- {self.log}:\n{self.log_tail()}") from None
        _wait_until(self.is_up, "PostgreSQL", self.log, timeout=timeout)

    def stop(self) -> None:
        """Fast shutdown: running transactions roll back, then a checkpoint."""
        self._ctl("-m", "fast", "-w", "stop")

    def crash(self) -> None:
        """Immediate shutdown: every backend dies, nothing is checkpointed, and
        the next start runs crash recovery from the WAL."""
        self._ctl("-m", "immediate", "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def is_up(self) -> bool:
        """True when the server accepts connections (pg_isready)."""
        command = [str(self.bindir / "pg_isready"), "-q", "-h", self.host, "-p", str(self.port)]
        done = subprocess.run([*command, "-t", "1"], env=_plain_env(), check=False)
        return done.returncode == 0

    def _shutdown(self) -> None:
        """Cleanup that never raises: fast stop, else immediate, else SIGKILL."""
        pidfile = self.datadir / "postmaster.pid"
        for attempt in (self.stop, self.crash):
            if not pidfile.exists():
                return
            with contextlib.suppress(ServerError, subprocess.TimeoutExpired):
                attempt()
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int(pidfile.read_text().split()[0])
            # Only our postmaster: a stale pidfile may name a reused pid.
            if str(self.datadir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)

    def create_database(self, name: str) -> None:
        command = [str(self.bindir / "createdb"), "-h", self.host, "-p", str(self.port)]
        _run([*command, "-U", self.user, name], self.ctl_log, f"createdb {name}")

    def log_tail(self) -> str:
        return log_tail(self.log)


@contextlib.contextmanager
def private_postgres(dbname: str = "faults") -> Iterator[PrivatePostgres]:
    """A fresh PostgreSQL cluster with database ``dbname``; deleted afterwards."""
    bindir = _postgres_bindir()
    with _workdir("pg", for_postgres=True) as workdir:
        server = PrivatePostgres(bindir, workdir, free_port(), dbname)
        try:
            server.init()
            server.start()
            server.create_database(dbname)
            yield server
        finally:
            server._shutdown()


# ------------------------------------------------------------------ MariaDB


class PrivateMariaDB:
    """A throwaway MariaDB server: root without a password, 127.0.0.1 only."""

    host = HOST

    def __init__(self, workdir: Path, port: int, dbname: str) -> None:
        self.workdir, self.port, self.dbname = workdir, port, dbname
        self.user = "root"
        self.datadir = workdir / "data"
        self.socket = workdir / "mysqld.sock"
        self.log = workdir / "mariadb.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._mariadbd = require("mariadbd", "apt-get install mariadb-server")
        self._client = require("mariadb", "apt-get install mariadb-client")

    # Small InnoDB files: the default 100 MB redo log is most of the start-up.
    _innodb = ("--innodb-log-file-size=8M", "--innodb-buffer-pool-size=64M")

    def settings_env(self) -> dict[str, str]:
        """IDEMPOTENCY_TEST_DB* variables pointing tests/settings.py here."""
        return {
            "IDEMPOTENCY_TEST_DB": "mysql",
            "IDEMPOTENCY_TEST_DB_HOST": self.host,
            "IDEMPOTENCY_TEST_DB_PORT": str(self.port),
            "IDEMPOTENCY_TEST_DB_USER": self.user,
            "IDEMPOTENCY_TEST_DB_PASSWORD": "",
            "IDEMPOTENCY_TEST_DB_NAME": self.dbname,
        }

    def init(self) -> None:
        install = require("mariadb-install-db", "apt-get install mariadb-server")
        command = [
            install, "--no-defaults", f"--datadir={self.datadir}", "--user=root",
            "--auth-root-authentication-method=normal", "--skip-test-db",
            "--skip-name-resolve", *self._innodb,
        ]  # fmt: skip
        _run(command, self.log, "mariadb-install-db", cwd=self.workdir)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start on the same datadir (after a crash: InnoDB recovers) and wait
        until it accepts connections."""
        command = [
            self._mariadbd, "--no-defaults", f"--datadir={self.datadir}",
            f"--port={self.port}", f"--bind-address={HOST}", f"--socket={self.socket}",
            f"--pid-file={self.workdir / 'mysqld.pid'}", f"--tmpdir={self.workdir}",
            f"--log-error={self.log}", "--user=root", "--skip-name-resolve",
            "--max-connections=200", "--character-set-server=utf8mb4", *self._innodb,
        ]  # fmt: skip
        self.process = _launch("MariaDB", self.process, command, self.workdir)
        _wait_until(self.is_up, "MariaDB", self.log, self.process, timeout)

    def stop(self) -> None:
        """Normal shutdown (SIGTERM), SIGKILL if it takes over a minute."""
        _stop_process(self.process, grace=60)
        self.process = None

    def crash(self) -> None:
        """SIGKILL: no shutdown at all; the next start recovers from the redo log."""
        _kill_process(self.process)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def is_up(self) -> bool:
        """True when a query over TCP works."""
        return self.sql("SELECT 1", check=False)

    def sql(self, statement: str, check: bool = True) -> bool:
        """Run one statement with the mariadb client over TCP."""
        command = [
            self._client, "--no-defaults", "--protocol=tcp", f"-h{self.host}",
            f"-P{self.port}", f"-u{self.user}", "--connect-timeout=2", "-e", statement,
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command, env=_plain_env(), capture_output=True, timeout=30, check=False
            )
        except subprocess.TimeoutExpired:
            if check:
                raise ServerError(f"{statement!r} took over 30 s") from None
            return False
        if check and done.returncode != 0:
            raise ServerError(f"{statement!r} failed: {done.stderr.decode(errors='replace')}")
        return done.returncode == 0

    def log_tail(self) -> str:
        return log_tail(self.log)


@contextlib.contextmanager
def private_mariadb(dbname: str = "faults") -> Iterator[PrivateMariaDB]:
    """A fresh MariaDB datadir with database ``dbname`` (utf8mb4); deleted afterwards."""
    with _workdir("mariadb") as workdir:
        server = PrivateMariaDB(workdir, free_port(), dbname)
        try:
            server.init()
            server.start()
            server.sql(f"CREATE DATABASE `{dbname}` CHARACTER SET utf8mb4")
            yield server
        finally:
            server.stop()


# -------------------------------------------------------------------- Redis


class PrivateRedis:
    """A throwaway Redis with no persistence: a restart starts empty."""

    host = HOST

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir, self.port = workdir, port
        self.url = f"redis://{HOST}:{port}/0"
        self.log = workdir / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._binary = require("redis-server", "apt-get install redis-server")

    def settings_env(self) -> dict[str, str]:
        return {"IDEMPOTENCY_TEST_REDIS_URL": self.url}

    def start(self, timeout: float = START_TIMEOUT) -> None:
        command = [
            self._binary, "--port", str(self.port), "--bind", HOST, "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir), "--logfile", str(self.log),
            "--daemonize", "no",
        ]  # fmt: skip
        self.process = _launch("Redis", self.process, command, self.workdir)
        _wait_until(self.is_up, "Redis", self.log, self.process, timeout)

    def stop(self) -> None:
        _stop_process(self.process)
        self.process = None

    def kill(self) -> None:
        """SIGKILL: clients get connection errors until ``start()``."""
        _kill_process(self.process)
        self.process = None

    def is_up(self) -> bool:
        """True when the server answers PING."""
        try:
            with socket.create_connection((HOST, self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


@contextlib.contextmanager
def private_redis() -> Iterator[PrivateRedis]:
    with _workdir("redis") as workdir:
        server = PrivateRedis(workdir, free_port())
        try:
            server.start()
            yield server
        finally:
            server.stop()


# ---------------------------------------------------------------- pgbouncer


class PgBouncer:
    """pgbouncer in front of one PostgreSQL server; every database name passes through."""

    host = HOST

    def __init__(self, workdir: Path, port: int, user: str, dbname: str) -> None:
        self.workdir, self.port, self.user, self.dbname = workdir, port, user, dbname
        self.ini = workdir / "pgbouncer.ini"
        self.log = workdir / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._binary = require("pgbouncer", "apt-get install pgbouncer")

    def settings_env(self) -> dict[str, str]:
        """IDEMPOTENCY_TEST_DB* for the app through pgbouncer, with the psycopg
        settings transaction pooling needs (see tests/server_settings.py)."""
        return {
            "IDEMPOTENCY_TEST_DB": "postgres",
            "IDEMPOTENCY_TEST_DB_HOST": self.host,
            "IDEMPOTENCY_TEST_DB_PORT": str(self.port),
            "IDEMPOTENCY_TEST_DB_USER": self.user,
            "IDEMPOTENCY_TEST_DB_PASSWORD": "",
            "IDEMPOTENCY_TEST_DB_NAME": self.dbname,
            "IDEMPOTENCY_TEST_PGBOUNCER": "1",
        }

    def conninfo(self, dbname: str | None = None) -> str:
        return (
            f"host={self.host} port={self.port} user={self.user} "
            f"dbname={dbname or self.dbname} connect_timeout=5"
        )

    def start(self, timeout: float = START_TIMEOUT) -> None:
        self.process = _launch(
            "pgbouncer", self.process, [self._binary, str(self.ini)], self.workdir, **_as_postgres()
        )
        _wait_until(lambda: _port_open(self.port), "pgbouncer", self.log, self.process, timeout)

    def stop(self) -> None:
        _stop_process(self.process)
        self.process = None

    def kill(self) -> None:
        _kill_process(self.process)
        self.process = None


@contextlib.contextmanager
def pgbouncer(
    upstream_host: str | PrivatePostgres,
    upstream_port: int | None = None,
    *,
    user: str = "postgres",
    dbname: str | None = None,
    pool_mode: str = "transaction",
    pool_size: int = 10,
    max_client_conn: int = 200,
) -> Iterator[PgBouncer]:
    """pgbouncer (trust auth, ``pool_mode``) forwarding every database to the
    upstream server. Pass a ``PrivatePostgres`` (preferred) or a host and port;
    the upstream must trust ``user``. ``dbname`` is what ``settings_env()`` and
    ``conninfo()`` name (default: the private cluster's database)."""
    port: int | None
    if isinstance(upstream_host, PrivatePostgres):
        host, port = upstream_host.host, upstream_host.port
        dbname = dbname or upstream_host.dbname
    else:
        host, port = upstream_host, upstream_port
    if port is None:
        raise TypeError("pgbouncer() needs upstream_port with a host name")
    with _workdir("pgbouncer", for_postgres=True) as workdir:
        bouncer = PgBouncer(workdir, free_port(), user, dbname or "postgres")
        (workdir / "userlist.txt").write_text(f'"{user}" ""\n')
        bouncer.ini.write_text(
            "[databases]\n"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            f"listen_addr = {HOST}\nlisten_port = {bouncer.port}\n"
            f"unix_socket_dir = {workdir}\n"
            f"pidfile = {workdir / 'pgbouncer.pid'}\nlogfile = {bouncer.log}\n"
            f"auth_type = trust\nauth_file = {workdir / 'userlist.txt'}\n"
            f"admin_users = {user}\nstats_users = {user}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\n"
            f"max_client_conn = {max_client_conn}\n"
        )
        for path in workdir.iterdir():
            _chown_postgres(path)
        try:
            bouncer.start()
            yield bouncer
        finally:
            bouncer.stop()


# ---------------------------------------------------------------- faketime


def _libfaketime() -> str:
    for pattern in (
        "/usr/lib/*/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    pytest.skip("libfaketime not found: apt-get install faketime")


# time.sleep for processes under libfaketime 0.9.10. Python 3.11+ sleeps with
# clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME), which that libfaketime
# turns into EINVAL when the monotonic clock is not faked
# (wolfcw/libfaketime#426); select() sleeps on a relative timeout it leaves alone.
_SLEEP_SHIM = '''"""Written by tests/servers.py: time.sleep that works under libfaketime."""
import select
import time


def _sleep(seconds):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    select.select([], [], [], seconds)


time.sleep = _sleep
'''


def faketime_env(spec: str, workdir: Path) -> dict[str, str]:
    """Environment that shifts a Python process's wall clock by ``spec``
    (libfaketime syntax: ``+5m``, ``-30s``, ``+2h``, ``+1d``).

    Only the wall clock moves (time.time, datetime.now): libfaketime 0.9.10
    fakes CLOCK_MONOTONIC as the faked wall clock (wolfcw/libfaketime#390), on
    which every Event.wait/Lock.acquire timeout hangs forever, so monotonic
    stays real; the sitecustomize written to ``workdir`` fixes time.sleep for
    that case. FAKETIME_DONT_RESET keeps forked gunicorn workers on the
    master's offset; NO_FAKE_STAT keeps file times real, since gunicorn's
    worker heartbeat is a file's mtime compared with the monotonic clock.
    """
    shim = workdir / "faketime-shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(_SLEEP_SHIM)
    return {
        "LD_PRELOAD": _libfaketime(),
        "FAKETIME": spec,
        "FAKETIME_DONT_RESET": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "NO_FAKE_STAT": "1",
        "PYTHONPATH": str(shim),
    }


def python_env(
    env: Mapping[str, str] | None = None, faketime: str | None = None, workdir: Path | None = None
) -> dict[str, str]:
    """The environment of a Python subprocess serving tests/server_settings.py:
    this process's, minus its test-backend and faketime variables, plus ``env``.
    ``faketime`` needs a ``workdir`` for its sitecustomize."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("IDEMPOTENCY_TEST_", "FAKETIME"))
        and name not in ("LD_PRELOAD", "NO_FAKE_STAT", "DJANGO_SETTINGS_MODULE", "PYTHONPATH")
    }
    result = {
        **inherited,
        "DJANGO_SETTINGS_MODULE": "tests.server_settings",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    paths = [str(ROOT)]
    if faketime is not None:
        if workdir is None:
            raise TypeError("python_env(faketime=...) needs a workdir for its sitecustomize")
        fake = faketime_env(faketime, workdir)
        paths.insert(0, fake.pop("PYTHONPATH"))
        result.update(fake)
    result["PYTHONPATH"] = os.pathsep.join(paths)
    return result


# ------------------------------------------------------------- app server

_PREPARE = """
import json, os
import django
django.setup()
from django.contrib.auth.models import User
from django.core.management import call_command
call_command("migrate", interactive=False, verbosity=0)
for name, password in json.loads(os.environ["IDEMPOTENCY_PREPARE_USERS"]):
    user, _ = User.objects.get_or_create(username=name)
    user.set_password(password)
    user.save()
"""


def prepare_database(
    env: Mapping[str, str], users: Sequence[tuple[str, str]] = USERS, timeout: float = 120
) -> None:
    """Migrate the database ``env`` names and create ``users`` (name, password)
    for Basic auth, in one process (one Django start-up instead of two)."""
    full = python_env({**env, "IDEMPOTENCY_PREPARE_USERS": json.dumps(list(users))})
    done = subprocess.run(
        [sys.executable, "-c", _PREPARE], cwd=ROOT, env=full, capture_output=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-3000:].decode("utf-8", "replace")
        raise ServerError(f"migrate failed ({done.returncode}):\n{output}")


class AppServer:
    """A gunicorn serving tests.urls; ``env`` is its full environment."""

    def __init__(
        self, process: subprocess.Popen[bytes], port: int, log: Path, env: dict[str, str]
    ) -> None:
        self.process, self.port, self.log, self.env = process, port, log, env
        self.host = HOST
        self.url = f"http://{HOST}:{port}"

    @property
    def pid(self) -> int:
        """The gunicorn master."""
        return self.process.pid

    def worker_pids(self) -> list[int]:
        """The master's live children: the workers, to SIGKILL mid-request."""
        pids = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # exited while we looked
            if int(fields[1]) == self.pid and fields[0] != "Z":
                pids.append(int(stat.split("/")[2]))
        return sorted(pids)

    def stop(self) -> None:
        """Graceful stop (SIGTERM), then SIGKILL to the master and its workers."""
        _stop_process(self.process, grace=15)

    def log_tail(self) -> str:
        return log_tail(self.log)


@contextlib.contextmanager
def app_server(
    env: Mapping[str, str],
    workers: int = 2,
    threads: int = 1,
    faketime: str | None = None,
    timeout: int = 120,
    extra_args: Sequence[str] = (),
) -> Iterator[AppServer]:
    """gunicorn ``tests.wsgi:application`` on a free port with ``env`` (e.g. a
    private server's ``settings_env()``): sync workers, or gthread ones when
    ``threads > 1``; ``faketime`` shifts its wall clock (see faketime_env).

    ``--preload`` imports Django once in the master, so the workers fork
    ready to serve and a worker the test kills is replaced at once.
    """
    port = free_port()
    with _workdir("gunicorn") as workdir:
        full_env = python_env(env, faketime=faketime, workdir=workdir)
        log = workdir / "gunicorn.log"
        command = [
            sys.executable, "-m", "gunicorn", "tests.wsgi:application",
            "--bind", f"{HOST}:{port}", "--workers", str(workers),
            "--worker-class", "gthread" if threads > 1 else "sync", "--threads", str(threads),
            "--timeout", str(timeout), "--graceful-timeout", "10", "--preload",
            "--worker-tmp-dir", str(workdir), "--log-level", "info",
            "--access-logfile", "-", "--error-logfile", "-", *_no_control_socket(), *extra_args,
        ]  # fmt: skip
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        server = AppServer(process, port, log, full_env)
        try:
            _wait_until(
                lambda: _answers_http(port) and len(server.worker_pids()) >= workers,
                "gunicorn", log, process,
            )  # fmt: skip
            yield server
        finally:
            server.stop()


def _no_control_socket() -> list[str]:
    """gunicorn 24+ opens a control socket at one fixed path in $HOME, which
    two app servers at once would fight over; fault tests use signals."""
    import gunicorn.config

    return ["--no-control-socket"] if "control_socket" in gunicorn.config.Config().settings else []


def _answers_http(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=2)
        conn.request("GET", "/charges/")
        conn.getresponse().read()
        conn.close()
        return True
    except (OSError, http.client.HTTPException):
        return False


# ------------------------------------------------------------ HTTP client


class Response(NamedTuple):
    status: int
    headers: http.client.HTTPMessage  # case-insensitive .get()
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(
    url: str,
    path: str,
    json_body: Any,
    key: str | None,
    auth: tuple[str, str] | None = USERS[0],
    timeout: float = 30.0,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """One POST on a fresh connection (so any number of threads can fire at
    once). ``json_body`` is serialised unless it is bytes; ``key=None`` sends
    no Idempotency-Key. Connection errors and timeouts raise OSError."""
    rest = url.split("://", 1)[-1]
    host, _, port = rest.partition("/")[0].partition(":")
    body = json_body if isinstance(json_body, bytes) else json.dumps(json_body).encode()
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["Idempotency-Key"] = key
    if auth is not None:
        sent["Authorization"] = "Basic " + b64encode(":".join(auth).encode()).decode()
    conn = http.client.HTTPConnection(host, int(port or 80), timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers=sent)
        response = conn.getresponse()
        return Response(response.status, response.headers, response.read())
    finally:
        conn.close()
