from __future__ import annotations

import itertools
import sys
import textwrap
import threading
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test.utils import override_settings

from idempotency_app.conf import conf, resolve_callable


def test_defaults() -> None:
    assert conf.TTL == 24 * 3600
    assert conf.LEASE == 60
    assert {"POST", "PATCH"} == conf.METHODS
    assert "content-type" in conf.STORED_HEADERS


def test_read_on_every_access() -> None:
    with override_settings(IDEMPOTENCY={"TTL": timedelta(hours=1), "METHODS": ["post", "put"]}):
        assert conf.TTL == 3600
        assert {"POST", "PUT"} == conf.METHODS
    assert conf.TTL == 24 * 3600


def test_the_dict_is_looked_up_again_whenever_django_says_it_changed(settings: Any) -> None:
    """The dict is kept between requests: each way a test or a project
    changes it must still be seen at once."""
    assert conf.LEASE == 60  # the dict (or its absence) is now held
    settings.IDEMPOTENCY = {"LEASE": 90}  # pytest-django's fixture
    assert conf.LEASE == 90
    settings.IDEMPOTENCY["LEASE"] = 120  # changed in place
    assert conf.LEASE == 120
    with override_settings(IDEMPOTENCY={"LEASE": 30}):
        assert conf.LEASE == 30
        with override_settings(IDEMPOTENCY="not a dict"):
            assert conf.LEASE == 60
    assert conf.LEASE == 120


def test_another_settings_change_keeps_the_dict() -> None:
    held = conf.user_settings
    with override_settings(USE_TZ=django_settings.USE_TZ):
        assert conf.user_settings is held


def test_never_stored_headers_cannot_be_added() -> None:
    with override_settings(
        IDEMPOTENCY={"STORE_HEADERS": ["Set-Cookie", "Authorization", "X-Request-Id"]}
    ):
        assert "x-request-id" in conf.STORED_HEADERS
        assert "set-cookie" not in conf.STORED_HEADERS
        assert "authorization" not in conf.STORED_HEADERS


def test_a_dotted_path_is_read_off_its_module_or_imported_as_django_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hook's path is read off its module on each call (a patch is seen);
    a module not imported yet is imported, and a wrong path fails as
    Django's ``import_string`` says."""
    import colorsys

    assert resolve_callable("colorsys.rgb_to_hsv") is colorsys.rgb_to_hsv
    monkeypatch.setattr(colorsys, "rgb_to_hsv", len)
    assert resolve_callable("colorsys.rgb_to_hsv") is len
    monkeypatch.delitem(sys.modules, "colorsys")
    assert resolve_callable("colorsys.hsv_to_rgb").__module__ == "colorsys"
    assert "colorsys" in sys.modules
    with pytest.raises(ImportError, match='does not define a "no_such_hook"'):
        resolve_callable("colorsys.no_such_hook")
    with pytest.raises(ImportError, match="doesn't look like a module path"):
        resolve_callable("no_dots")


MODULE = "tests_conf_slow_hook"


def test_a_module_another_thread_is_still_importing_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hook whose module another thread is still importing is not read
    off the half-run module (which may rebind it later: a decorator applied
    at the end, a registry filled in); the import is waited for, as
    Django's ``import_string`` waits."""
    (tmp_path / f"{MODULE}.py").write_text(
        textwrap.dedent(
            """
            import threading
            started = threading.Event()
            proceed = threading.Event()

            def hook(request):
                return "unfinished"

            import sys
            sys.modules[__name__].__dict__["started_flag"] = True
            _events = sys.modules["tests.test_conf"].EVENTS
            _events["started"].set()
            _events["proceed"].wait(5)

            def hook(request):  # noqa: F811 (rebound once the module is ready)
                return "finished"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    EVENTS["started"].clear()
    EVENTS["proceed"].clear()
    importer = threading.Thread(target=__import__, args=(MODULE,))
    importer.start()
    try:
        assert EVENTS["started"].wait(5)
        # Release the importer a moment after resolution starts: the old code
        # (import_string) blocks on the module's import lock until then.
        threading.Timer(0.3, EVENTS["proceed"].set).start()
        found = resolve_callable(f"{MODULE}.hook")
        assert found(None) == "finished"
    finally:
        EVENTS["proceed"].set()
        importer.join(5)
        sys.modules.pop(MODULE, None)


EVENTS: dict[str, threading.Event] = {
    "started": threading.Event(),
    "proceed": threading.Event(),
}


def test_the_policy_made_once_follows_every_change_of_the_settings(settings: Any) -> None:
    """``Policy.from_settings`` keeps what it made: a change of the settings
    (in place, or by Django's signal) and per-call durations must each give
    the policy they make, and a refused combination must be refused again."""
    from django.core.exceptions import ImproperlyConfigured

    from idempotency_app.lifecycle.claims import Policy

    settings.IDEMPOTENCY = {"TTL": 600, "LEASE": 30, "WAIT_FOR_IN_FLIGHT": 2}
    first = Policy.from_settings()
    assert (first.ttl, first.lease, first.wait, first.using) == (600, 30, 2, "default")
    assert Policy.from_settings() is first
    settings.IDEMPOTENCY["TTL"] = timedelta(minutes=20)  # changed in place
    assert Policy.from_settings().ttl == 1200
    settings.IDEMPOTENCY["TRANSIENT_ERROR_TTL"] = 7
    assert Policy.from_settings().marker == 7
    assert Policy.from_settings(ttl=5).ttl == 5
    assert Policy.from_settings(lease=45).lease == 45
    for _ in range(2):
        with pytest.raises(ImproperlyConfigured, match="WAIT_FOR_IN_FLIGHT is 2s"):
            Policy.from_settings(lease=1)
    with override_settings(IDEMPOTENCY={"DATABASE_ALIAS": "other", "LEASE": 9}):
        assert (Policy.from_settings().using, Policy.from_settings().lease) == ("other", 9)
    settings.IDEMPOTENCY["LEASE"] = [30]  # not a duration, nor a key: made, and refused, each time
    with pytest.raises(TypeError):
        Policy.from_settings()
    settings.IDEMPOTENCY["LEASE"] = 30
    assert Policy.from_settings() == Policy(1200, 30, 2, "default", 7)


def test_policies_made_for_many_per_call_durations_stay_bounded(settings: Any) -> None:
    from idempotency_app.lifecycle import claims

    for ttl in range(1, 3 * claims.MAX_POLICIES):
        assert claims.Policy.from_settings(ttl=ttl).ttl == ttl
    assert len(claims._POLICIES) <= claims.MAX_POLICIES


def test_a_per_call_duration_gets_a_policy_of_its_own_type(settings: Any) -> None:
    """``Decimal(5) == 5``: a policy kept for one must not be handed to the
    other (a Decimal TTL fails where the claim adds it to a float, and must
    not make every later call with ``ttl=5`` fail too)."""
    from decimal import Decimal

    from idempotency_app.lifecycle.claims import Policy

    settings.IDEMPOTENCY = {}
    assert type(Policy.from_settings(ttl=Decimal(5)).ttl) is Decimal
    assert type(Policy.from_settings(ttl=5).ttl) is int
    assert type(Policy.from_settings(ttl=True).ttl) is bool
    assert type(Policy.from_settings(ttl=5.0).ttl) is float


class _ChangedWhileRead(dict):  # type: ignore[type-arg]
    """A settings dict that another thread changes (TTL to 200) just after
    the last setting a policy depends on is read."""

    armed = False

    def get(self, name: str, default: Any = None) -> Any:
        value = super().get(name, default)
        if name == "TRANSIENT_ERROR_TTL" and self.armed:
            self.armed = False
            self["TTL"] = 200
        return value


def test_a_policy_is_made_from_the_settings_it_is_kept_under(settings: Any) -> None:
    """Settings changed while a policy is made must not leave it kept under
    the values read before the change."""
    from idempotency_app.lifecycle.claims import Policy

    settings.IDEMPOTENCY = _ChangedWhileRead({"TTL": 100})
    racing = settings.IDEMPOTENCY
    racing.armed = True
    assert Policy.from_settings().ttl == 100  # made from what was read
    assert Policy.from_settings().ttl == 200  # the change is seen at the next call
    racing["TTL"] = 100
    assert Policy.from_settings().ttl == 100


class _Seconds(float):
    """A float whose conversion says otherwise (a unit-carrying number)."""

    def __float__(self) -> float:
        return 7.0


class _Alias(str):
    def __str__(self) -> str:
        return "other"


class _HashRefused:
    def __hash__(self) -> int:
        raise ValueError("not hashable here")

    def __float__(self) -> float:
        return 30.0


def _outcome(read: Any) -> Any:
    try:
        return ("ok", read())
    except Exception as exc:
        return ("raised", type(exc))


@pytest.mark.parametrize(
    ("name", "first", "then", "attribute"),
    [
        (
            "TTL",
            Decimal("1e400"),
            10**400,
            "TTL",
        ),  # equal and hashed alike; inf, then OverflowError
        ("TRANSIENT_ERROR_TTL", Decimal("1e400"), Fraction(10**400), "TRANSIENT_ERROR_TTL"),
        ("TTL", 5.0, _Seconds(5.0), "TTL"),
        ("DATABASE_ALIAS", "default", _Alias("default"), "DATABASE_ALIAS"),
        ("LEASE", 30.0, _HashRefused(), "LEASE"),
    ],
    ids=["decimal-then-int", "decimal-then-fraction", "float-subclass", "str-subclass", "no-hash"],
)
def test_the_policy_agrees_with_the_settings_after_an_equal_value_of_another_type(
    settings: Any, name: str, first: Any, then: Any, attribute: str
) -> None:
    """Found by a review: settings keyed by equality alone handed one value's
    policy to an equal value of another type that converts otherwise."""
    from idempotency_app.lifecycle.claims import Policy

    field = {"TTL": "ttl", "LEASE": "lease", "DATABASE_ALIAS": "using"}.get(name, "marker")
    settings.IDEMPOTENCY = {name: first}
    _outcome(Policy.from_settings)
    settings.IDEMPOTENCY = {name: then}
    expected = _outcome(lambda: getattr(conf, attribute))
    assert _outcome(lambda: getattr(Policy.from_settings(), field)) == expected


def test_threads_changing_the_settings_never_keep_a_policy_under_other_values(
    settings: Any,
) -> None:
    from idempotency_app.lifecycle import claims

    shared: dict[str, Any] = {"TTL": 100}
    settings.IDEMPOTENCY = shared
    claims._POLICIES.clear()  # only this test's policies are checked below
    stop = threading.Event()
    wrong: list[Any] = []

    def change() -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            shared["TTL"] = [100, 200.0, Decimal(300), timedelta(seconds=400)][i % 4]

    def read() -> None:
        for _ in range(3000):
            if claims.Policy.from_settings().ttl not in (100, 200, 300, 400):
                wrong.append(1)

    changer = threading.Thread(target=change)
    readers = [threading.Thread(target=read) for _ in range(6)]
    for thread in (changer, *readers):
        thread.start()
    for thread in readers:
        thread.join()
    stop.set()
    changer.join()
    assert not wrong
    for key, policy in list(claims._POLICIES.items()):
        ttl = key[3]  # the TTL setting, after the three per-call durations
        assert policy.ttl == (ttl.total_seconds() if isinstance(ttl, timedelta) else float(ttl))
