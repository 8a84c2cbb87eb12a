"""The physical limit: what a request's statements cost with no Python around them (PostgreSQL).

    .venv/bin/python -m benchmarks.limit [--batches 10] [--per-batch 200]

The bench project's write view sends BEGIN, two INSERTs and COMMIT. Under
``@idempotent`` a fresh request sends, on top, the claim (its function,
committed alone) and the completion, which travels with the COMMIT; a replay
sends the claim alone. Here those very statements (the view's as Django
wrote them, the library's as its store builds them) are sent through
libpq's own call from a tight loop, every text built before the clock
starts: what the requests would cost if no Python ran between them. Next to
them, in the same batches, the same requests through Django's test client.

The difference between the two "added" figures is what the library's own
Python costs a request; the limit's "added" is what no client code can
take away: the claim's round trip, the server's work for the claim and the
completion, and the larger commit. Each scenario alternates with the others
in batches, so whatever else the machine does weighs on all alike; medians
of the batches' means.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable

from benchmarks.common import (
    AUTH,
    BODY,
    alternate,
    machine,
    print_machine,
    reset_schema,
    setup_django,
    table,
    use_database,
)


def view_statements() -> list[str]:
    """The two INSERTs one undecorated request sends, as Django wrote them
    (the ledger row refers to that request's charge, which stays)."""
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        Client(**AUTH).post("/plain/", BODY, content_type="application/json")
    sent = [query["sql"] for query in captured.captured_queries]
    inserts = [sql for sql in sent if sql.startswith("INSERT")]
    assert len(inserts) == 2, sent
    return inserts


def statements_alone(per_batch: int) -> dict[str, Callable[[], None]]:
    """Each scenario's statements, sent through libpq with no Python
    between them but the loop's; the texts of ``per_batch`` requests are
    built ahead of each batch."""
    from django.db import connection
    from psycopg import pq

    from idempotency_app import store
    from idempotency_app.store import Identity, StoredResponse
    from idempotency_app.store.postgresql import _CLAIM_TYPES, CLAIM_ARGUMENTS

    records = store.backend("default")
    connection.ensure_connection()
    assert records.claim_statement(True) == records.claim_calls[True], "migrate to 0007"
    pgconn = connection.connection.pgconn
    kept = connection.connection.cursor()  # mogrifies the completion as the library does
    charge, ledger = (sql.encode() for sql in view_statements())
    response = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id":1}' * 4)
    claim_call = records.unseen_claim_calls[True]

    def exec_(message: bytes, params: list[bytes] | None = None) -> None:
        if params is None:
            result = pgconn.exec_(message)
        else:
            result = pgconn.exec_params(message, params, _CLAIM_TYPES)
        if result.status == pq.ExecStatus.FATAL_ERROR:
            raise RuntimeError(result.error_message.decode())

    def claim_values(identity: Identity, token: str) -> list[bytes]:
        params = records.claim_params(identity, token, 86400, 60)
        texts = [str.encode(params[name]) for name in CLAIM_ARGUMENTS[:5]]
        return texts + [repr(float(params[name])).encode() for name in CLAIM_ARGUMENTS[5:]]

    def completion(identity: Identity, token: str, sql: str) -> bytes:
        params = records.complete_params(identity, token, response, 86400)
        return f'RELEASE SAVEPOINT "s1"; {kept.mogrify(sql, params)}'.encode()

    def fresh_texts(sql: str) -> tuple[list[bytes], bytes]:
        identity = Identity("user:1", str(uuid.uuid4()), "POST idem/", "f" * 64)
        token = uuid.uuid4().hex
        return claim_values(identity, token), completion(identity, token, sql)

    replayed = Identity("user:1", f"replay-{uuid.uuid4()}", "POST idem/", "f" * 64)
    token = uuid.uuid4().hex
    exec_(claim_call, claim_values(replayed, token))
    exec_(b'BEGIN; SAVEPOINT "s1"')
    exec_(completion(replayed, token, records.completion_statement(True)))
    replay_values = claim_values(replayed, uuid.uuid4().hex)

    def plain() -> None:
        for _ in range(per_batch):
            exec_(b"BEGIN")
            exec_(charge)
            exec_(ledger)
            exec_(b"COMMIT")

    def fresh(sql: str, riding: bool = False) -> Callable[[], None]:
        """``riding``: the BEGIN and the view's SAVEPOINT sent with its first
        INSERT, one round trip fewer (a lever measured, not taken)."""

        def batch() -> None:
            texts = [fresh_texts(sql) for _ in range(per_batch)]
            for claim, finish in texts:
                exec_(claim_call, claim)
                if riding:
                    exec_(b'BEGIN; SAVEPOINT "s1"; ' + charge)
                else:
                    exec_(b'BEGIN; SAVEPOINT "s1"')
                    exec_(charge)
                exec_(ledger)
                exec_(finish)

        return batch

    def replay() -> None:
        for _ in range(per_batch):
            exec_(claim_call, replay_values)

    return {
        "plain": plain,
        "fresh": fresh(records.completion_statement(True)),
        # As before migration 0008: the completion as a statement.
        "fresh, completion statement": fresh(records.complete_commit_sql),
        "fresh, riding": fresh(records.completion_statement(True), riding=True),
        "replay": replay,
    }


def through_django(per_batch: int) -> dict[str, Callable[[], None]]:
    """The same requests in process, through Django's test client: ``floor``
    (an authenticated view that sends nothing), the undecorated write view,
    the decorated one with a new key, and a retry of a completed key."""
    from django.test import Client

    client = Client(**AUTH)
    replayed = f"replay-{uuid.uuid4()}"

    def send(path: str, key: Callable[[], str | None]) -> Callable[[], None]:
        def batch() -> None:
            for _ in range(per_batch):
                extra = {}
                if (value := key()) is not None:
                    extra["HTTP_IDEMPOTENCY_KEY"] = value
                client.post(path, BODY, content_type="application/json", **extra)

        return batch

    def cached(batch: Callable[[], None]) -> Callable[[], None]:
        """``batch`` with ``REPLAY_CACHE`` on: the first retry of each batch
        reads the record, the rest are answered from memory, which is
        emptied after it (the other batches' retries read the record)."""
        from django.conf import settings
        from django.test import override_settings

        from idempotency_app.lifecycle import replays

        def with_cache() -> None:
            with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "REPLAY_CACHE": 5}):
                try:
                    batch()
                finally:
                    replays.clear()

        return with_cache

    send("/idem/", lambda: replayed)()
    return {
        "floor": send("/floor/", lambda: None),
        "least replay": send("/least-replay/", lambda: replayed),
        "plain": send("/plain/", lambda: None),
        "fresh": send("/idem/", lambda: str(uuid.uuid4())),
        "replay": send("/idem/", lambda: replayed),
        "replay, cached": cached(send("/idem/", lambda: replayed)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--per-batch", type=int, default=200)
    args = parser.parse_args()
    use_database("postgres")
    setup_django()
    reset_schema()
    print_machine(machine())
    alone = statements_alone(args.per_batch)
    django = through_django(args.per_batch)
    in_memory = ("floor", "least replay", "replay, cached")
    both = {f"alone {name}": call for name, call in alone.items()}
    both |= {f"django {name}": call for name, call in django.items() if name not in in_memory[1:]}
    wall, _ = alternate(both, args.batches, args.per_batch)
    # Apart, once the server has settled: its background work after the
    # writes would weigh on requests that send nothing.
    time.sleep(2)
    _, cpu = alternate({name: django[name] for name in in_memory}, args.batches, args.per_batch)

    def row(what: str, alone_us: float | None, django_us: float | None) -> list[str]:
        return [what, *("" if us is None else f"{us:,.0f}" for us in (alone_us, django_us))]

    a, d = (lambda n: wall[f"alone {n}"]), (lambda n: wall[f"django {n}"])
    rows = [
        row("floor (sends nothing)", None, d("floor")),
        row("plain: the undecorated write view", a("plain"), d("plain")),
        row("fresh: a new key", a("fresh"), d("fresh")),
        row(
            "  its completion as a statement (before 0008)", a("fresh, completion statement"), None
        ),
        row(
            "  the BEGIN and SAVEPOINT with the first INSERT (not taken)",
            a("fresh, riding"),
            None,
        ),
        row("replay: a completed key", a("replay"), d("replay")),
        row("fresh - plain (added)", a("fresh") - a("plain"), d("fresh") - d("plain")),
        row("replay - floor (added)", a("replay"), d("replay") - d("floor")),
    ]
    print(table(["wall us per request", "statements alone", "through Django"], rows))
    ratios = [
        ["fresh / plain, throughput", f"{a('plain') / a('fresh'):.2f}x", ""],
        ["  with Django's own cost added to both", "", f"{d('plain') / d('fresh'):.2f}x"],
        [
            "  the library's Python taken away",
            "",
            f"{d('plain') / (d('plain') + a('fresh') - a('plain')):.2f}x",
        ],
        ["replay / floor, throughput", "", f"{d('floor') / d('replay'):.2f}x"],
        [
            "  the library's Python taken away",
            "",
            f"{d('floor') / (d('floor') + a('replay')):.2f}x",
        ],
    ]
    print(table(["ratio", "statements alone", "through Django"], ratios))
    # Replays from memory send nothing: CPU time, which a busy machine's
    # preemptions do not inflate, measures them.
    memory = [
        [
            what,
            f"{cpu[name]:,.0f}",
            f"{cpu[name] - cpu['floor']:+,.0f}",
            f"{cpu['floor'] / cpu[name]:.2f}x",
        ]
        for what, name in (
            ("floor (sends nothing)", "floor"),
            ("the least a replay in memory does", "least replay"),
            ("a replay with REPLAY_CACHE", "replay, cached"),
        )
    ]
    print(table(["in memory, through Django", "CPU us", "added", "floor / it"], memory))
    print(
        f"(medians of {args.batches} batches of {args.per_batch} requests each, scenarios "
        "alternating; 'the library's Python taken away': the undecorated request (or the "
        "floor) plus the added cost of the statements alone, the best the library could do "
        "here; 'the least a replay in memory does': authentication, reading and hashing the "
        "body with the principal and the key, sending the stored bytes)"
    )
    reset_schema()


if __name__ == "__main__":
    main()
