from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import DefaultRouter

from example_project.payments import views

router = DefaultRouter()
router.register("accounts", views.AccountViewSet, basename="account")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/accounts/<int:account_id>/charges/", views.create_charge, name="create-charge"),
    path("api/charges/<int:charge_id>/refunds/", views.RefundView.as_view(), name="create-refund"),
    path("api/", include(router.urls)),
    path("webhooks/", include("example_project.payments.webhooks")),
]
