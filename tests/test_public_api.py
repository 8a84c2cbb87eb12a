"""The public API: every name in ``idempotency_app.__all__`` imports from the
package, lazily (safe before Django's apps load), and every exception the
library raises derives from ``idempotency_app.Error`` while keeping the base
it always had."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest
from rest_framework.exceptions import APIException

import idempotency_app
from idempotency_app import exceptions


def test_every_public_name_imports_from_the_package() -> None:
    for name in idempotency_app.__all__:
        if name in ("enqueue_once", "aenqueue_once"):
            pytest.importorskip("django_tasks", reason="enqueue_once needs django.tasks")
        assert getattr(idempotency_app, name) is not None, name
    assert set(dir(idempotency_app)) >= set(idempotency_app.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        idempotency_app.nothing_here  # type: ignore[attr-defined]  # noqa: B018


def test_type_checkers_see_exactly_the_public_names() -> None:
    """The names imported for type checkers are those the package serves."""
    source = inspect.getsource(idempotency_app)
    typed = set(re.findall(r"(\w+) as \1\b", source))
    assert typed == set(idempotency_app.__all__)


def test_importing_the_package_needs_no_configured_django() -> None:
    """``import idempotency_app`` in settings.py, before Django is set up."""
    code = (
        "import os, sys; os.environ.pop('DJANGO_SETTINGS_MODULE', None); "
        "import idempotency_app; "
        "assert 'django.conf' not in sys.modules or "
        "not __import__('django.conf').conf.settings.configured; "
        "print(len(idempotency_app.__all__))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(idempotency_app.__all__)


def test_every_exception_has_one_root_and_keeps_its_base() -> None:
    raised = [
        value
        for value in vars(exceptions).values()
        if inspect.isclass(value)
        and issubclass(value, Exception)
        and value.__module__ == exceptions.__name__
    ]
    assert len(raised) >= 20
    for exc in raised:
        assert issubclass(exc, idempotency_app.Error), exc
    kept = {
        "IdempotencyError": APIException,
        "CannotBeAtomic": RuntimeError,
        "InvalidKey": ValueError,
        "UnstorableIdentity": ValueError,
        "ClaimLost": idempotency_app.KeyInProgress,
        "TransactionEnded": idempotency_app.CannotBeAtomic,
    }
    for name, base in kept.items():
        assert issubclass(getattr(idempotency_app, name), base), name
    for name in idempotency_app.__all__:
        value = getattr(idempotency_app, name, None)
        if inspect.isclass(value) and issubclass(value, Exception):
            assert value in raised, f"{name} is public but not in idempotency_app.exceptions"


@pytest.mark.parametrize(
    ("old", "name"),
    [
        ("idempotency_app.keys", "user_scope"),
        ("idempotency_app.keys", "fingerprint"),
        ("idempotency_app.work", "CannotBeAtomic"),
        ("idempotency_app.openapi", "AutoSchema"),
        ("idempotency_app.metrics", "OUTCOMES"),
    ],
)
def test_a_module_that_moved_still_imports_with_a_warning(old: str, name: str) -> None:
    """A settings string may name the old path ("SCOPE":
    "idempotency_app.keys.user_scope"): it works for one more release."""
    import importlib
    import warnings

    from django.utils.module_loading import import_string

    if name == "AutoSchema":
        pytest.importorskip("drf_spectacular", reason="needs drf-spectacular")
    if name == "OUTCOMES":
        pytest.importorskip("prometheus_client", reason="needs prometheus-client")
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to"):
        module = importlib.import_module(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert import_string(f"{old}.{name}") is getattr(module, name)


@pytest.mark.parametrize("name", ["encode", "decode", "make_identity", "LOOKUP_BATCH"])
def test_service_names_that_became_internal_still_work_with_a_warning(name: str) -> None:
    from idempotency_app import service

    with pytest.warns(DeprecationWarning, match=f"idempotency_app.service.{name}"):
        assert getattr(service, name) is not None
