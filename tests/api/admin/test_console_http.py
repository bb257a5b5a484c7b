"""The admin console's login session and CSRF protection over HTTP, in process.

Oracles: the cookie as the server sets it, the admin REST API (what exists afterwards), and the
tenant endpoints (a key works or not).
"""

from __future__ import annotations

import pytest
from fastapi import FastAPI

from tests.api.admin.console_helpers import (
    ADMIN,
    BASE_URL,
    admin_api,
    browser,
    login,
    new_tenant_name,
)

# ---- login and sessions -----------------------------------------------------------------------------


def test_pages_without_a_session_go_to_login_and_data_gets_401(app: FastAPI) -> None:
    client = browser(app)
    r = client.get("/admin/tenants?x=1", headers={"Accept": "text/html"})
    assert r.status_code == 303 and r.headers["location"] == "/admin/login?next=%2Fadmin%2Ftenants%3Fx%3D1"
    assert client.get("/admin/login").status_code == 200
    for path in ("/admin/overview.json", "/admin/usage.csv"):
        r = client.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "login_required"
    assert client.get("/admin/static/console.js").status_code == 200  # assets need no login
    assert client.get("/admin/static/../settings.py").status_code == 404


def test_admin_key_signs_in_with_an_opaque_strict_http_only_cookie(app: FastAPI) -> None:
    client = browser(app)
    r = client.post("/admin/login", data={"admin_key": ADMIN, "next": "/admin/usage"})
    assert r.status_code == 303 and r.headers["location"] == "/admin/usage"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin" in cookie
    session_id = client.cookies["loraserve_console"]
    assert ADMIN not in cookie and len(session_id) >= 43
    assert client.get("/admin").status_code == 200
    assert client.get("/admin/login").headers["location"] == "/admin"  # already signed in
    # A second login gets a fresh id and the old one stops working (no session fixation).
    client.post("/admin/login", data={"admin_key": ADMIN})
    assert client.cookies["loraserve_console"] != session_id
    stale = browser(app)
    stale.cookies.set("loraserve_console", session_id)
    assert stale.get("/admin", headers={"Accept": "text/html"}).status_code == 303


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/admin", "/v1/models"])
def test_login_never_redirects_off_the_console(app: FastAPI, target: str) -> None:
    r = browser(app).post("/admin/login", data={"admin_key": ADMIN, "next": target})
    assert r.status_code == 303 and r.headers["location"] == "/admin"


def test_wrong_admin_key_and_tenant_keys_are_refused(app: FastAPI) -> None:
    tenant_key = admin_api(app, "POST", "/tenants", json={"name": new_tenant_name()})["api_key"]
    client = browser(app)
    wrong = client.post("/admin/login", data={"admin_key": ADMIN + "x"})
    assert (
        wrong.status_code == 401 and "Incorrect admin key" in wrong.text and "set-cookie" not in wrong.headers
    )
    as_tenant = client.post("/admin/login", data={"admin_key": tenant_key})
    assert as_tenant.status_code == 403 and "Tenant API keys cannot" in as_tenant.text
    assert "set-cookie" not in as_tenant.headers
    for key in (tenant_key, ADMIN):  # an Authorization header never opens a console page
        for path in ("/admin", "/admin/tenants", "/admin/overview.json"):
            r = client.get(path, headers={"Authorization": f"Bearer {key}", "Accept": "text/html"})
            assert r.status_code == 401, (path, r.status_code)
    assert (
        browser(app).get("/admin/api/tenants", headers={"Authorization": f"Bearer {tenant_key}"}).status_code
        == 401
    )


def test_logout_ends_the_session_on_the_server(app: FastAPI) -> None:
    client = browser(app)
    csrf = login(client)
    session_id = client.cookies["loraserve_console"]
    assert client.post("/admin/logout").status_code == 403  # needs the CSRF token too
    r = client.post("/admin/logout", data={"csrf_token": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/admin/login"
    replay = browser(app)
    replay.cookies.set("loraserve_console", session_id)
    assert replay.get("/admin/overview.json").status_code == 401


# ---- CSRF -------------------------------------------------------------------------------------------


def test_posts_without_the_sessions_csrf_token_are_refused_and_change_nothing(app: FastAPI) -> None:
    client, other = browser(app), browser(app)
    csrf, other_csrf = login(client), login(other)
    name = new_tenant_name()
    attempts = [
        ({"name": name}, {}),  # no token
        ({"name": name, "csrf_token": "forged"}, {}),
        ({"name": name, "csrf_token": other_csrf}, {}),  # another session's token
        ({"name": name, "csrf_token": csrf}, {"Origin": "https://evil.example"}),
    ]
    for form, headers in attempts:
        r = client.post("/admin/tenants", data=form, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed", (form, headers, r.text)
    assert name not in [t["name"] for t in admin_api(app, "GET", "/tenants")["data"]]
    # The header form of the token (what fetch() would send) is accepted.
    r = client.post("/admin/tenants", data={"name": name}, headers={"X-CSRF-Token": csrf, "Origin": BASE_URL})
    assert r.status_code == 200 and name in [t["name"] for t in admin_api(app, "GET", "/tenants")["data"]]
