from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import SimpleRouter

from tests.testapp import views

router = SimpleRouter()
router.register("viewset-charges", views.ChargeViewSet)

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
    path("", include(router.urls)),
]
