"""A throwaway PostgreSQL server for tests: `initdb` + `pg_ctl start` in a temporary folder, on a free port of
127.0.0.1, trust authentication, fsync off; stopped and removed at the end of the session.

    from tests.postgres import postgres, pg_database  # noqa: F401  (fixtures)

    def test_x(pg_database):
        url = pg_database()             # postgresql://postgres@127.0.0.1:PORT/test_N, a fresh empty database

The server runs as an unprivileged user: as root (PostgreSQL refuses to run as root) it is the `postgres` user the
Debian package creates, through `runuser`. Without the binaries the tests skip with the reason; CI installs Debian's
`postgresql` package (Makefile SYSTEM_PACKAGES), so there they run.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)  # the newest version first
    return candidates[0] if candidates else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PREFIX = "reviewer-pg-"


def sweep_orphans(pg_ctl: str, user: str | None) -> None:
    """Servers of earlier test sessions that were killed before their teardown (SIGKILL, a CI timeout): stop them and
    remove their folders. Only folders this module made and whose owning process is gone are touched."""
    for folder in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            owner = int((folder / "owner").read_text())
        except (OSError, ValueError):
            continue  # not ours, or being set up right now
        try:
            os.kill(owner, 0)
            continue  # its session is still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        prefix = ["runuser", "-u", user, "--"] if user else []
        subprocess.run(prefix + [pg_ctl, "-D", str(folder / "data"), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


class PostgresServer:
    def __init__(self):
        self.initdb, self.pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
        if not (self.initdb and self.pg_ctl):
            pytest.skip("PostgreSQL binaries (initdb, pg_ctl) not found: install Debian's `postgresql` package")
        pytest.importorskip("psycopg", reason="the PostgreSQL driver is missing: pip install 'reviewer[postgres]'")
        self.user = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root and there is no `postgres` user to run the test server as")
            self.user = "postgres"
        sweep_orphans(self.pg_ctl, self.user)
        # Not under pytest's tmp_path: that is private to root, and the server runs as `postgres`.
        self.folder = Path(tempfile.mkdtemp(prefix=PREFIX))
        (self.folder / "owner").write_text(str(os.getpid()))  # a later session stops the server if we were killed
        self.data, self.log = self.folder / "data", self.folder / "server.log"
        if self.user:
            shutil.chown(self.folder, self.user)
        self.port = free_port()
        self.databases = 0

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        return subprocess.run(prefix + list(argv), capture_output=True, text=True, timeout=120)

    def start(self) -> PostgresServer:
        made = self.run(self.initdb, "-D", str(self.data), "--auth=trust", "-U", "postgres", "-E", "UTF8",
                        "--no-sync", "--no-instructions")
        if made.returncode:
            raise RuntimeError(f"initdb failed: {made.stderr or made.stdout}")
        return self.resume()

    def halt(self) -> None:
        """Stop the server abruptly, keeping its data (a crash or a network cut, as clients see it)."""
        self.run(self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def resume(self) -> PostgresServer:
        """Start the server (again) on the same data, port and socket folder."""
        # fsync off (a test server need not survive a power cut) but synchronous_commit on: with it off, a halt()
        # right after a commit could lose that commit (seen: a finished review's queue row came back 'running')
        options = (f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c full_page_writes=off -c max_connections=200")
        started = self.run(self.pg_ctl, "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "-t", "60",
                           "start")
        if started.returncode:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {started.stderr or started.stdout}\n{log}")
        return self

    def stop(self) -> None:
        self.run(self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        import psycopg

        self.databases += 1
        name = f"test_{self.databases}_{os.getpid()}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                                     autocommit=True) as conn:
                    conn.execute(f'CREATE DATABASE "{name}"')
                return self.url(name)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@pytest.fixture(scope="session")
def postgres():
    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture
def pg_database(postgres):
    """Factory: a fresh empty database on the session's server, as a postgresql:// URL."""
    return postgres.create_database
