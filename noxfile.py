"""The supported matrix: each Django with the Python versions it supports.

    nox -l                                   # the sessions
    nox -s "tests(django61-py313)"           # one pair
    nox -r -s "tests(django42-py310)" -- tests/test_decorators.py   # reuse its venv

The backend variables of ./runtests (IDEMPOTENCY_TEST_DB, _REDIS_URL, ...)
pass through, so a pair runs on PostgreSQL or MariaDB as well as SQLite.
Python interpreters are looked up on PATH, and in pyenv's versions when
pyenv is there. .ci/run runs the oldest pair and the newest one.
"""

from __future__ import annotations

import fcntl
import glob
import os
import sys

import nox

# The pyenv interpreters, so "python3.10" resolves without `pyenv global`.
_pyenv = os.path.expanduser(os.environ.get("PYENV_ROOT", "~/.pyenv"))
os.environ["PATH"] = os.pathsep.join(
    [*sorted(glob.glob(f"{_pyenv}/versions/3.*/bin"), reverse=True), os.environ["PATH"]]
)

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

DJANGO = {
    "4.2": "django>=4.2,<5.0",
    "5.2": "django>=5.2,<6.0",
    "6.0": "django>=6.0,<6.1",
    "6.1": "django>=6.1,<6.2",
}
PYTHONS = {
    "4.2": ["3.10", "3.11", "3.12"],
    "5.2": ["3.10", "3.11", "3.12", "3.13"],
    "6.0": ["3.12", "3.13"],
    "6.1": ["3.12", "3.13"],
}
PAIRS = [(python, django) for django, pythons in PYTHONS.items() for python in pythons]


def _extras(django: str) -> str:
    extras = ["test"]
    if django != "4.2":
        extras.append("tasks")  # django-tasks-db needs Django 5.2+
    backend = os.environ.get("IDEMPOTENCY_TEST_DB", "sqlite")
    if backend in ("postgres", "postgresql"):
        extras.append("postgres")
    elif backend in ("mysql", "mariadb"):
        extras.append("mysql")
    return ",".join(extras)


@nox.session
@nox.parametrize(
    "python,django",
    PAIRS,
    ids=[f"django{d.replace('.', '')}-py{p.replace('.', '')}" for p, d in PAIRS],
)
def tests(session: nox.Session, django: str) -> None:
    """The test suite on one (Python, Django) pair."""
    pins = [DJANGO[django]]
    if django == "4.2":
        # The oldest supported pair, with the oldest asgiref the library takes.
        pins += ["djangorestframework>=3.15,<3.16", "asgiref>=3.9.1,<3.10"]
    # Sessions run at once (.ci/run) write the same egg-info here: one
    # installs at a time.
    os.makedirs(".nox", exist_ok=True)
    with open(".nox/.install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        session.install("--disable-pip-version-check", "-e", f".[{_extras(django)}]", *pins)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *session.posargs)


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy strict, with nox's own Python
    (the dev extra: pip install -e ".[dev]")."""
    session.run(sys.executable, "-m", "ruff", "check", ".")
    session.run(sys.executable, "-m", "ruff", "format", "--check", "--exclude", "*.md", ".")
    session.run(sys.executable, "-m", "mypy")
