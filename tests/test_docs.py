"""The system check ids the docs name are the ones the package emits.

A page that names the wrong check sends a reader to the wrong fix, and a
check nobody documented cannot be looked up from its id.
"""

from __future__ import annotations

import re
from pathlib import Path

from django.test.utils import override_settings

from idempotency_app.viewchecks import check_idempotent_views

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# In prose the prefix is often left off: "check `W008` warns".
NAMED = re.compile(r"\b(?:idempotency_app\.)?([EW]0\d\d)\b")
EMITTED = re.compile(r'\bid="idempotency_app\.([EW]\d\d\d)"')


def emitted_ids() -> set[str]:
    return {
        f"idempotency_app.{code}"
        for path in (ROOT / "idempotency_app").rglob("*.py")
        for code in EMITTED.findall(path.read_text())
    }


def named_ids() -> dict[str, list[str]]:
    """Each check id the docs name, with the pages that name it."""
    named: dict[str, list[str]] = {}
    for page in DOCS:
        for code in sorted(set(NAMED.findall(page.read_text()))):
            named.setdefault(f"idempotency_app.{code}", []).append(page.name)
    return named


def test_the_package_emits_checks() -> None:
    # So that a pattern that finds nothing cannot make the tests below pass.
    assert {"idempotency_app.E001", "idempotency_app.E030", "idempotency_app.W001"} <= (
        emitted_ids()
    )


def test_every_check_the_docs_name_exists() -> None:
    unknown = {id_: pages for id_, pages in named_ids().items() if id_ not in emitted_ids()}
    assert unknown == {}


def test_every_check_is_documented() -> None:
    assert emitted_ids() - set(named_ids()) == set()


def test_async_docs_name_the_check_that_refuses_a_plain_view() -> None:
    """The refusals table of docs/async.md names the check that refuses an
    @idempotent view served without DRF."""
    with override_settings(ROOT_URLCONF="tests.testapp.plain_urls"):
        emitted = {error.id for error in check_idempotent_views()}
    assert emitted  # the test URLconf serves such views
    row = next(
        line
        for line in (ROOT / "docs" / "async.md").read_text().splitlines()
        if line.startswith("| `@idempotent` on a plain Django view")
    )
    assert {f"idempotency_app.{code}" for code in NAMED.findall(row)} == emitted
