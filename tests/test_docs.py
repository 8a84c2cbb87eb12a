"""The system check IDs the docs name are the ones the package has.

A page that names the wrong check sends a reader to the wrong fix, and a
check nobody documented cannot be looked up from its ID. The package's
checks are the table ``idempotency_app.checks.CHECKS``; every message is
made from it, and docs/reference.md lists it.
"""

from __future__ import annotations

import re
from pathlib import Path

from django.test.utils import override_settings

from idempotency_app import checks
from idempotency_app.checks import CHECKS, check_idempotent_views

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# In prose the prefix is often left off: "check `W008` warns".
NAMED = re.compile(r"\b(?:idempotency_app\.)?([EW]0\d\d)\b")
# How the checks make their messages: _message("E001", ...).
EMITTED = re.compile(r'_message\(\s*"([EW]\d\d\d)"')


def emitted_ids() -> set[str]:
    return {f"idempotency_app.{code}" for code in CHECKS}


def named_ids() -> dict[str, list[str]]:
    """Each check id the docs name, with the pages that name it."""
    named: dict[str, list[str]] = {}
    for page in DOCS:
        for code in sorted(set(NAMED.findall(page.read_text()))):
            named.setdefault(f"idempotency_app.{code}", []).append(page.name)
    return named


def test_every_check_in_the_table_is_emitted_and_nothing_else() -> None:
    """The table is the checks: each ID is made into a message somewhere,
    and no message uses an ID the table lacks (``_message`` refuses it)."""
    source = Path(checks.__file__).read_text()
    assert set(EMITTED.findall(source)) == set(CHECKS)
    assert {"E001", "E030", "W001", "W010"} <= set(CHECKS)


def test_the_reference_lists_exactly_the_table() -> None:
    reference = (ROOT / "docs" / "reference.md").read_text()
    listed = set(re.findall(r"^\| `idempotency_app\.([EW]\d\d\d)` \|", reference, re.M))
    assert listed == set(CHECKS)


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
