"""The CORS checks: a browser client on another origin must be able to send
the key and read the protocol's headers."""

from __future__ import annotations

from typing import Any

from corsheaders.defaults import default_headers
from django.core import checks
from django.test.utils import override_settings

from idempotency_app.checks import check_cors_headers

GOOD = {
    "CORS_ALLOW_HEADERS": (*default_headers, "idempotency-key"),
    "CORS_EXPOSE_HEADERS": ["Idempotent-Replayed", "Idempotency-Expires", "Retry-After"],
}


def ids(**settings: Any) -> list[str]:
    with override_settings(**settings):
        return [message.id or "" for message in check_cors_headers()]


def test_a_complete_configuration_passes() -> None:
    assert ids(**GOOD) == []


def test_defaults_say_what_to_add() -> None:
    with override_settings():
        messages = check_cors_headers()
    assert [m.id for m in messages] == ["idempotency_app.W008", "idempotency_app.W009"]
    allow, expose = messages
    assert '"idempotency-key"' in (allow.hint or "")
    assert '"Idempotent-Replayed", "Idempotency-Expires", "Retry-After"' in (expose.hint or "")
    assert all(isinstance(m, checks.Warning) for m in messages)


def test_only_missing_exposed_headers_are_named() -> None:
    with override_settings(
        **{**GOOD, "CORS_EXPOSE_HEADERS": ["retry-after", "IDEMPOTENT-REPLAYED"]}
    ):
        (message,) = check_cors_headers()
    assert message.id == "idempotency_app.W009"
    assert message.msg.startswith("CORS_EXPOSE_HEADERS does not expose Idempotency-Expires:")


def test_names_are_case_insensitive() -> None:
    assert ids(**{**GOOD, "CORS_ALLOW_HEADERS": ["Idempotency-Key"]}) == []


def test_a_custom_header_is_the_one_checked() -> None:
    with override_settings(**GOOD, IDEMPOTENCY={"HEADER": "X-Request-Key"}):
        (message,) = check_cors_headers()
    assert message.id == "idempotency_app.W008" and "'X-Request-Key'" in message.msg


def test_a_wildcard_counts_only_without_credentials() -> None:
    wildcard = {"CORS_ALLOW_HEADERS": ["*"], "CORS_EXPOSE_HEADERS": ["*"]}
    assert ids(**wildcard) == []
    assert ids(**wildcard, CORS_ALLOW_CREDENTIALS=True) == [
        "idempotency_app.W008",
        "idempotency_app.W009",
    ]


def test_malformed_settings_are_left_to_django_cors_headers() -> None:
    assert ids(CORS_ALLOW_HEADERS="idempotency-key", CORS_EXPOSE_HEADERS=[1, 2]) == []


def test_registered_by_ready_only_with_django_cors_headers() -> None:
    from django.conf import settings

    registry = checks.registry.registry
    assert check_cors_headers not in registry.get_checks()  # the test settings lack corsheaders
    try:
        with override_settings(INSTALLED_APPS=[*settings.INSTALLED_APPS, "corsheaders"]):
            assert check_cors_headers in registry.get_checks()
    finally:
        registry.registered_checks.discard(check_cors_headers)


def test_the_example_project_passes() -> None:
    from example_project import settings as example

    assert "corsheaders" in example.INSTALLED_APPS
    assert (
        ids(
            CORS_ALLOW_HEADERS=example.CORS_ALLOW_HEADERS,
            CORS_EXPOSE_HEADERS=example.CORS_EXPOSE_HEADERS,
        )
        == []
    )
