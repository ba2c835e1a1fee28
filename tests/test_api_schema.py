"""Property-based requests over the OpenAPI spec (schemathesis): no route answers 5xx.

Generated bodies, paths and query strings hit every operation of the live server with a valid key;
the only check is "not a server error", so validation, 401/404/409/413/422 answers all pass and any
crash or unhandled exception fails. Few examples per operation keep it under two minutes on 2 cores.
(schemathesis' own pytest plugin does not load under this pytest, so hypothesis drives its strategies.)
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings

from api_server import KEY_A

pytest_plugins = ["state_fixtures", "api_server"]


def test_no_server_errors(api_server):
    with api_server.http(KEY_A) as h:
        raw = h.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 30
    seen: list[str] = []

    for operation in operations:

        @settings(max_examples=4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case: schemathesis.Case) -> None:
            response = case.call(base_url=api_server.url, headers={"x-api-key": KEY_A}, timeout=60)
            assert response.status_code < 500, (
                case.method,
                case.formatted_path,
                case.body,
                response.text[:300],
            )
            seen.append(f"{case.method} {case.operation.path}")

        check()
    assert len(set(seen)) == len(operations)
