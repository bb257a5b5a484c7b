"""The Responses API's stored responses, per tenant: `store: true` keeps a response for the server's
retention (`response_retention_s`), `previous_response_id` continues from one, `GET` / `DELETE
/v1/responses/{id}` read and remove one (registry/stored_responses.py holds the rows).

- What is kept: the whole conversation the response answered (the previous response's conversation,
  then its own output, then this request's input, as Responses input items) and the response object.
  `previous_response_id` puts that conversation before the new input; `instructions` are the new
  request's own (as OpenAI: they are not carried over).
- Another tenant's id, one never stored, one deleted: the same 404 `response_not_found` (nothing
  leaks); one past its retention: 404 naming the retention. Expired rows are purged at the next save.
- Metering is the chat path's own: storing changes nothing billed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from api.errors import APIError
from registry.errors import NotFound
from registry.stored_responses import (
    Expired,
    StoredResponse,
    delete_response,
    get_response,
    save_response,
)


def _retention(seconds: float) -> str:
    days = seconds / 86400
    return f"{days:g} days" if days >= 1 else f"{seconds:g} s"


class StoredResponses:
    def __init__(self, sessions: Callable[[], Session], *, retention_s: float) -> None:
        self.sessions = sessions
        self.retention_s = retention_s

    def conversation(self, *, tenant_id: str, response_id: str) -> list[dict[str, Any]]:
        """The stored response's conversation and its output, as input items to continue from."""
        stored = self._get(tenant_id, response_id, param="previous_response_id")
        return [*stored.input_items, *stored.response.get("output", [])]

    def save(self, *, tenant_id: str, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        with self.sessions() as session:
            save_response(
                session, tenant_id=tenant_id, response_id=response["id"], input_items=input_items,
                response=response, retention_s=self.retention_s,
            )  # fmt: skip

    def get(self, *, tenant_id: str, response_id: str) -> dict[str, Any]:
        return self._get(tenant_id, response_id, param="response_id").response

    def delete(self, *, tenant_id: str, response_id: str) -> dict[str, Any]:
        self._get(tenant_id, response_id, param="response_id")  # an expired one is gone already
        try:
            with self.sessions() as session:
                delete_response(session, tenant_id=tenant_id, response_id=response_id)
        except NotFound:
            raise self._not_found(response_id, "response_id") from None
        return {"id": response_id, "object": "response", "deleted": True}

    def _get(self, tenant_id: str, response_id: str, *, param: str) -> StoredResponse:
        try:
            with self.sessions() as session:
                return get_response(session, tenant_id=tenant_id, response_id=response_id)
        except NotFound:
            raise self._not_found(response_id, param) from None
        except Expired as exc:
            raise APIError(
                404,
                f"response {response_id!r} expired at {exc.expires_at.isoformat()}: stored responses are "
                f"kept for {_retention(self.retention_s)} (response_retention_s)",
                param=param,
                code="response_not_found",
            ) from None

    def _not_found(self, response_id: str, param: str) -> APIError:
        return APIError(
            404,
            f"response {response_id!r} not found: this tenant has no stored response of that id (only "
            f"`store: true` responses are kept, for {_retention(self.retention_s)})",
            param=param,
            code="response_not_found",
        )
