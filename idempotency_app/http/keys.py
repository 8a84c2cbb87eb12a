"""What identifies an idempotent request: its key, scope, operation and fingerprint."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import tempfile
from typing import Any

import orjson
from django.apps import apps
from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db.models import Model
from django.http import HttpRequest
from django.http.request import RawPostDataException
from django.utils.http import parse_header_parameters
from rest_framework.exceptions import ParseError

from idempotency_app.conf import conf
from idempotency_app.exceptions import IdempotencyScopeMissing, InvalidKey

logger = logging.getLogger("idempotency_app")

MAX_KEY_LENGTH = 255
# What bounded() puts before a hash.
HASHED_PREFIX = "sha256:"
# Re-serialising JSON costs more than hashing it (about 0.4 ms for 64 KB);
# above this size the raw bytes are fingerprinted instead.
CANONICAL_JSON_MAX_BYTES = 64 * 1024


def parse_key(raw: str | None) -> str | None:
    """Return the key from a header value, ``None`` when the header is absent.

    Accepts a Structured-Field string (``"abc"``) and unquotes it.
    """
    if raw is None:
        return None
    value = raw.strip(" \t")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = _unquote_sf_string(value[1:-1])
    if not value.strip():
        raise InvalidKey("The Idempotency-Key header is empty.")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidKey(f"The Idempotency-Key header is longer than {MAX_KEY_LENGTH} characters.")
    if not (value.isascii() and value.isprintable()):  # space to tilde
        raise InvalidKey("The Idempotency-Key header may hold printable ASCII characters only.")
    return value


def _unquote_sf_string(inner: str) -> str:
    out = []
    chars = iter(inner)
    for ch in chars:
        if ch == "\\":
            escaped = next(chars, "")
            if escaped not in ('"', "\\"):
                raise InvalidKey(
                    'The quoted Idempotency-Key has an invalid escape; only \\" and \\\\ are allowed.'
                )
            out.append(escaped)
        elif ch == '"':
            raise InvalidKey('The quoted Idempotency-Key has an unescaped " inside it.')
        else:
            out.append(ch)
    return "".join(out)


def user_scope(request: Any) -> str | None:
    """The default scope: the authenticated principal.

    A user (an instance of ``get_user_model()``, a proxy or a subclass of it)
    is ``user:<pk>``; any other saved model instance (a DRF authentication
    class may return a ``Partner``) is named by its model, ``<app_label>.
    <model_name>:<pk>``, so that principals of two models never share a
    scope. Anonymous requests get no scope, and the key is refused: two
    anonymous clients must never share a stored response. A principal the
    library cannot tell apart from others (unsaved, or not a model at all,
    such as simplejwt's ``TokenUser``) is refused too, and logged: set
    ``SCOPE`` to a callable of your own for it.
    """
    user = getattr(request, "user", None)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    pk = user.pk if isinstance(user, Model) else None
    if pk is None:
        raise _unidentified(user)
    if isinstance(user, _user_model(settings.AUTH_USER_MODEL)):
        return f"user:{pk}"
    # A proxy or a multi-table child shares its pk with the model at the
    # root of its inheritance: the same row, the same principal.
    parents = user._meta.get_parent_list()
    root = parents[-1] if parents else type(user)
    return f"{root._meta.label_lower}:{pk}"


@functools.lru_cache(maxsize=4)
def _user_model(label: str) -> type[Model]:
    """``get_user_model()``, looked up once per process (for each setting)."""
    model: type[Model] = apps.get_model(label, require_ready=False)
    return model


def _unidentified(user: Any) -> IdempotencyScopeMissing:
    kind = type(user)
    logger.warning(
        "Refused an Idempotency-Key from a %s.%s principal: the default SCOPE names a "
        "principal by its saved model instance, and this one is %s. Set "
        'IDEMPOTENCY["SCOPE"] to a callable that returns a stable string for each principal.',
        kind.__module__,
        kind.__qualname__,
        "unsaved" if isinstance(user, Model) else "not a Django model instance",
    )
    return IdempotencyScopeMissing(
        "This API cannot tell this client apart from others, so it cannot accept an "
        "Idempotency-Key from it. Send the request without the Idempotency-Key header."
    )


def http_request(request: Any) -> HttpRequest:
    """Django's request under DRF's: its attributes read there directly,
    where DRF's ``Request`` finds them only after its own lookup failed."""
    django_request: HttpRequest = getattr(request, "_request", request)
    return django_request


def operation(request: Any) -> str:
    """HTTP method plus the view's route pattern, not the concrete path (the
    root's route is empty, and stays so). Without a resolved route, the path;
    too long for the column, its hash: never a truncation, which could make
    two operations one."""
    django_request = http_request(request)
    match = getattr(django_request, "resolver_match", None)
    route = (match.route or "") if match is not None else django_request.path_info
    return _operation(django_request.method, route)


@functools.lru_cache(maxsize=1024)
def _operation(method: str | None, route: str) -> str:
    """Once per method and route: they are as few as a project's routes."""
    return bounded(f"{method} {route}")


def content_type(request: Any) -> str:
    """The body's media type and charset, lowercased: the same bytes sent as
    another type, or decoded with another charset, are another request.
    Other parameters (a multipart boundary) do not count."""
    return _content_type(http_request(request).META.get("CONTENT_TYPE", ""))


@functools.lru_cache(maxsize=64)
def _content_type(raw: str) -> str:
    """Once per header value: clients send a few (a multipart body's
    boundary changes on each, and costs only the parsing it would anyway)."""
    media_type, params = parse_header_parameters(raw)
    charset = params.get("charset", "").strip().lower()
    return f"{media_type.lower()}; charset={charset}" if charset else media_type.lower()


# How a body is described in the fingerprint; the tag keeps the forms apart.
RAW, DIGEST, MULTIPART, PARSED = b"raw", b"sha256", b"multipart", b"parsed"


def request_body(request: Any) -> tuple[bytes, bytes]:
    """How the body is described, and the bytes that describe it.

    Multipart uploads are described by their fields and each file's SHA-256,
    read in chunks: Django streams them to disk. A raw body larger than
    ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (a file upload, a large JSON document)
    is hashed as it streams and put back for the parsers: reading ``body``
    would refuse it, although DRF's parsers accept it without a key."""
    django_request = http_request(request)
    content_type = django_request.META.get("CONTENT_TYPE", "")
    if content_type.lower().startswith("multipart/") and hasattr(request, "POST"):
        return MULTIPART, _multipart_description(request)
    # Only requests from a server (WSGI, ASGI) have a stream to put back.
    streamed = getattr(django_request, "_read_started", True)
    if not streamed and _too_large_for_body(django_request):
        return DIGEST, _digest_and_put_back(django_request)
    try:
        return RAW, django_request.body
    except RawPostDataException:
        # The stream was read before idempotency ran (a permission or an
        # authentication class parsed it); DRF keeps the parsed data.
        return PARSED, _parsed_description(request.data)


def _too_large_for_body(django_request: HttpRequest) -> bool:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return limit is not None and content_length(django_request) > limit


def content_length(django_request: HttpRequest) -> int:
    """The declared body length; ``ParseError`` (400) unless it is digits
    (Django reads another value as 0, and the view would see an empty body)."""
    raw = (django_request.META.get("CONTENT_LENGTH") or "0").strip(" \t")
    try:
        if raw.isascii() and raw.isdigit():
            return int(raw)
    except ValueError:  # more digits than int() reads
        pass
    raise ParseError("The Content-Length header must be a number of bytes.")


def _digest_and_put_back(django_request: HttpRequest) -> bytes:
    """SHA-256 of the stream, which is replaced by a spooled copy (in memory
    up to ``FILE_UPLOAD_MAX_MEMORY_SIZE``, then on disk) that reads the same."""
    stream = django_request._stream
    # Not closed here: the request reads it next, and closes it with itself.
    copy = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE)  # noqa: SIM115
    digest = hashlib.sha256()
    while chunk := stream.read(64 * 1024):
        digest.update(chunk)
        copy.write(chunk)
    copy.seek(0)
    django_request._stream = copy  # type: ignore[assignment]
    return digest.digest()


def _parsed_description(data: Any) -> bytes:
    """Parsed data, every value in it: a form's repeated fields all count,
    and an uploaded file by its contents, not its name."""
    if hasattr(data, "lists"):  # a QueryDict or MultiValueDict
        data = dict(data.lists())
    return json.dumps(data, sort_keys=True, default=_describe_value).encode()


def _describe_value(value: Any) -> Any:
    if isinstance(value, UploadedFile):
        return _file_description(value)
    return str(value)


def _file_description(upload: Any) -> list[Any]:
    """A file by its name, type, size and SHA-256, read in chunks."""
    digest = hashlib.sha256()
    for chunk in upload.chunks():
        digest.update(chunk)
    upload.seek(0)
    return [upload.name, upload.content_type, upload.size, digest.hexdigest()]


def _multipart_description(request: Any) -> bytes:
    """Fields by name, each with its values in the order sent (a view that
    reads ``getlist`` sees that order), and files by their contents."""
    fields = [[name, request.POST.getlist(name)] for name in sorted(request.POST)]
    files = [
        [name, *_file_description(upload)]
        for name in sorted(request.FILES)
        for upload in request.FILES.getlist(name)
    ]
    return json.dumps([fields, files], default=str).encode()


def canonical_body(request: Any, body: bytes) -> bytes:
    """JSON re-serialised with sorted keys, so that key order and whitespace
    are not a change, from the text the view will parse: DRF decodes the body
    strictly with its declared charset (UTF-8 by default).

    Every number is kept exactly as written, so that two bodies some parser
    could read apart are two requests whatever parser the view uses: 12.50
    and 12.5, 1E2 and 100, -0 and 0, digits past a float's precision (which
    ``parse_float=Decimal`` keeps). The standard library parses, keeping each
    number's text as an ``orjson.Fragment``, and orjson writes. (orjson alone
    would read numbers as floats; telling the bodies it could do apart costs
    about what it saves.) Data orjson cannot write (a lone surrogate, nesting
    deeper than 255) is written in the standard library's escaped form, which
    no other data shares. What the view would refuse (invalid, a BOM, NaN or
    Infinity, nesting too deep) is fingerprinted as its bytes."""
    if not body or len(body) > CANONICAL_JSON_MAX_BYTES or not _is_json(request.content_type):
        return body
    charset = http_request(request).encoding or settings.DEFAULT_CHARSET
    try:
        text = body.decode(charset)
        data = _DECODE_KEEPING_NUMBERS(text)
    except (ValueError, LookupError, RecursionError):  # UnicodeDecodeError is a ValueError
        return body
    try:
        return orjson.dumps(data, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        pass
    try:
        return _write(json.loads(text, parse_float=_Number, parse_int=_Number)).encode()
    except RecursionError:
        return body


@functools.lru_cache(maxsize=64)
def _is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON, once per header value."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


# json.dumps and json.loads build an encoder or decoder per call when given
# options; these are built once.
_encode_url_args = json.JSONEncoder(default=str).encode


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


_DECODE_KEEPING_NUMBERS = json.JSONDecoder(
    parse_constant=_refuse, parse_float=orjson.Fragment, parse_int=orjson.Fragment
).decode


class _Number(str):
    """A number's text, written back as it is."""


def _write(value: Any) -> str:
    """JSON with sorted keys in the standard library's escaped form, numbers
    as written: for the data orjson refuses to write."""
    if isinstance(value, dict):
        items = sorted(value.items())
        return "{" + ",".join(f"{json.dumps(k)}:{_write(v)}" for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_write(item) for item in value) + "]"
    if isinstance(value, _Number):
        return value
    return json.dumps(value)


def fingerprint(request: Any) -> str:
    """SHA-256 over what the request asks for, each part length-framed."""
    django_request = http_request(request)
    match = getattr(django_request, "resolver_match", None)
    form, body = request_body(request)
    parts: list[bytes] = [
        operation(django_request).encode(),  # the method and the route
        _url_args(match),
        form,
        canonical_body(request, body) if form is RAW else body,
    ]
    for name in conf.FINGERPRINT_QUERY_PARAMS:
        parts.append(json.dumps(django_request.GET.getlist(name)).encode())
    for name in conf.FINGERPRINT_HEADERS:
        parts.append(django_request.headers.get(name, "").encode("utf-8", "surrogateescape"))
    return framed_digest(parts)


def _url_args(match: Any) -> bytes:
    """The URL's arguments as JSON; most routes have none, and that text is known."""
    if match is None:
        return b"[]"
    if not match.args and not match.kwargs:
        return b"[[], []]"
    return _encode_url_args([list(match.args), sorted(match.kwargs.items())]).encode()


def identity_fingerprint(request: Any, fingerprint: str) -> str:
    """What the record and the guard compare: the fingerprint (the default
    one or a project's own) together with the body's content type and, when
    sent, its ``Content-Disposition`` (the file name a ``FileUploadParser``
    view reads), so that no ``FINGERPRINT`` can leave them out."""
    django_request = http_request(request)
    parts = [content_type(django_request), fingerprint]
    disposition = django_request.META.get("HTTP_CONTENT_DISPOSITION")
    if disposition:
        parts.append(disposition)
    return framed_digest([part.encode("utf-8", "surrogateescape") for part in parts])


def framed_digest(parts: list[bytes]) -> str:
    """SHA-256 over the parts, each preceded by its length (8 bytes), so
    that no two lists of parts hash the same bytes."""
    return hashlib.sha256(
        b"".join([len(part).to_bytes(8, "big") + part for part in parts])
    ).hexdigest()


def bounded(text: str) -> str:
    """Text longer than the 255-character columns, holding NUL (which
    PostgreSQL text cannot store) or a lone surrogate (which no database
    stores), is hashed: never truncated into a collision. So is text that
    starts as a hash does, so that no text kept as it is can be mistaken for
    another's hash. The hash reads every code point, surrogates included."""
    if (
        len(text) <= 255
        and "\x00" not in text
        and not text.startswith(HASHED_PREFIX)
        and (text.isascii() or _encodable(text))
    ):
        return text
    return HASHED_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
