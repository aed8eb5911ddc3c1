"""A throwaway PostgreSQL server for the tests of a study shared between machines.

The server comes from the OS packages (`.ci/run` installs Debian's ``postgresql`` where it is
missing); where it is not installed, or the Python driver is not, the tests that need it are skipped
with what is missing. PostgreSQL refuses to run as root, so under root the server runs as an
unprivileged user. It listens on a free port of 127.0.0.1 with trust authentication, and is stopped
and its files removed when the test ends, however it ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from dsauto.profile.launch import free_port

START_SECONDS = 60.0
"""How long the server may take to accept connections (a loaded machine is slow, not broken)."""


def _postgres_bin() -> Path | None:
    """The folder with ``initdb`` and ``postgres``: on PATH, else Debian's versioned folder
    (``/usr/lib/postgresql/<major>/bin``, which the ``postgresql`` package does not put on PATH)."""
    found = shutil.which("initdb")
    if found and (Path(found).resolve().parent / "postgres").exists():
        return Path(found).resolve().parent
    folders = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
                     if Path(p).parent.name.isdigit() else 0)
    folders = [Path(f) for f in folders if (Path(f) / "initdb").exists() and (Path(f) / "postgres").exists()]
    return folders[-1] if folders else None


def _server_user() -> pwd.struct_passwd | None:
    """Who runs the server: this user, or under root (which PostgreSQL refuses) an unprivileged one."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):  # the Debian package creates ``postgres``; ``nobody`` is everywhere
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    pytest.skip("PostgreSQL refuses to run as root and this machine has neither a 'postgres' nor a 'nobody' user")


def _shut_down_with_the_tests() -> None:
    """In the server's process before it starts: a fast shutdown when the test process dies, even by
    SIGKILL, when no ``finally`` runs (``prctl(PR_SET_PDEATHSIG)``, linux/prctl.h)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT, 0, 0, 0)


def _stop(server: subprocess.Popen) -> None:
    """Fast shutdown (SIGINT: roll back open transactions, end the backends), SIGKILL if it hangs."""
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=30)


@pytest.fixture
def postgres_url():
    """``postgresql://`` URL of an empty database on a fresh server, stopped afterwards."""
    psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL driver is missing: pip install -e '.[test]' "
                                  "(or dsauto[postgres]) installs psycopg")
    bin_dir = _postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL's initdb and postgres are not installed (neither on PATH nor in "
                    "/usr/lib/postgresql/*/bin); `apt-get install postgresql` installs them, as .ci/run does")
    user = _server_user()
    # Not under pytest's tmp_path: its folders are private to the test's user, and the server's is not.
    root = Path(tempfile.mkdtemp(prefix="dsauto-postgres-"))
    data, log = root / "data", root / "server.log"
    run_as = {} if user is None else {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    server = None
    try:
        if user is not None:
            os.chown(root, user.pw_uid, user.pw_gid)
        made = subprocess.run([str(bin_dir / "initdb"), "-D", str(data), "-U", "dsauto", "-A", "trust", "-E",
                               "UTF8", "--no-sync"], capture_output=True, text=True, env=env, cwd=root, **run_as)
        if made.returncode != 0:
            pytest.fail(f"initdb failed: {(made.stdout + made.stderr)[-2000:]}")
        port = free_port()
        # No fsync: a test's database need not survive a power cut, and fsync is slow on a loaded disk.
        with open(log, "wb") as output:
            server = subprocess.Popen([str(bin_dir / "postgres"), "-D", str(data), "-p", str(port),
                                       "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={root}",
                                       "-c", "fsync=off", "-c", "synchronous_commit=off",
                                       "-c", "full_page_writes=off"],
                                      stdout=output, stderr=subprocess.STDOUT, env=env, cwd=root,
                                      preexec_fn=_shut_down_with_the_tests, **run_as)
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                with psycopg.connect(host="127.0.0.1", port=port, user="dsauto", dbname="postgres",
                                     autocommit=True, connect_timeout=5) as connection:
                    connection.execute("CREATE DATABASE study")
                break
            except psycopg.OperationalError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the PostgreSQL server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)
        yield f"postgresql://dsauto@127.0.0.1:{port}/study"
    finally:
        if server is not None:
            _stop(server)
        shutil.rmtree(root, ignore_errors=True)
