from django.contrib import admin
from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from example_project.payments import async_views, views


def not_found(request: HttpRequest, exception: Exception) -> JsonResponse:
    """An API answers JSON even for a URL that matches no route (``/api/accounts/1.5/``)."""
    return JsonResponse({"detail": "Not found."}, status=404)


handler404 = not_found

router = DefaultRouter()
router.register("accounts", views.AccountViewSet, basename="account")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/accounts/<int:account_id>/charges/", views.create_charge, name="create-charge"),
    path(
        "api/accounts/<int:account_id>/async-charges/",
        async_views.create_charge_async,
        name="create-charge-async",
    ),
    path("api/charges/<int:charge_id>/refunds/", views.RefundView.as_view(), name="create-refund"),
    path("api/", include(router.urls)),
    path("webhooks/", include("example_project.payments.webhooks")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("", include("django_prometheus.urls")),  # /metrics
]
