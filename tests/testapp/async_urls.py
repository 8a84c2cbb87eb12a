"""URLs of the adrf async views; included by tests.urls where adrf is installed."""

from django.urls import path

from tests.testapp import async_views

urlpatterns = [
    path("charges/", async_views.charge_fn),
    path("plain-charges/", async_views.plain_charge_fn),
    path("tag-if-new/", async_views.tag_if_new),
    path("writes-to-other-database/", async_views.writes_to_other_database),
    path("charges-required/", async_views.charge_required_fn),
    path("accounts/<int:account>/charges/", async_views.ChargeView.as_view()),
    path("mixin-charges/", async_views.MixinChargeView.as_view()),
    path("viewset-charges/", async_views.ChargeViewSet.as_view({"post": "create"})),
    path(
        "viewset-charges/<str:pk>/",
        async_views.ChargeViewSet.as_view({"patch": "partial_update"}),
    ),
]
