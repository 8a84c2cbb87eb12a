from importlib.util import find_spec

from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import SimpleRouter

from tests.testapp import patterns, views

router = SimpleRouter()
router.register("viewset-charges", views.ChargeViewSet)
router.register("nested-charges", patterns.NestedViewSet, basename="nested")

PATTERNS = [
    path("tag-if-new/", patterns.tag_if_new),
    path("tag-if-new-atomic/", patterns.tag_if_new_atomic),
    path("inner-block-without-savepoint/", patterns.inner_block_without_savepoint),
    path("rolls-back-on-purpose/", patterns.rolls_back_on_purpose),
    path("durable-block/", patterns.durable_block),
    path("writes-to-other-database/", patterns.writes_to_other_database),
    path("swallows-other-database-error/", patterns.swallows_its_other_database_error),
    path("reads-other-database/", patterns.reads_other_database),
    path("dangling-foreign-key/", patterns.dangling_foreign_key),
    path("with-commit-hooks/", patterns.with_commit_hooks),
    path("locks-a-row/", patterns.locks_a_row),
    path("attachment/", patterns.attachment),
    path("upload/<str:filename>/", patterns.Upload.as_view()),
    path("forgiving/", patterns.Forgiving.as_view()),
    path("constant-fingerprint-a/", patterns.constant_fingerprint_a),
    path("constant-fingerprint-b/", patterns.constant_fingerprint_b),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("charges/", views.charge_fn),
    path("charges-required/", views.charge_required_fn),
    path("charges-anonymous/", views.charge_anonymous_fn),
    path("charges-throttled/", views.charge_throttled_fn),
    path("charges-cookie/", views.charge_with_cookie_fn),
    path("charges-stream/", views.stream_fn),
    path("accounts/<int:account>/charges/", views.AccountChargeView.as_view()),
    path("mixin-charges/", views.MixinChargeView.as_view()),
    path("patterns/", include(PATTERNS)),
    path("", include(router.urls)),
    path("", patterns.root),
]

if find_spec("adrf") is not None:
    urlpatterns.insert(0, path("async/", include("tests.testapp.async_urls")))
