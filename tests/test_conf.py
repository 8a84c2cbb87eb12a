from __future__ import annotations

import sys
from datetime import timedelta
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
