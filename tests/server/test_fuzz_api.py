"""Property-based fuzzing of every endpoint from the server's own /openapi.json (schemathesis), over
real HTTP against the tiny model: schema-valid and schema-violating bodies alike must never get a
5xx, every answer must be documented (status, content type, body schema), and every request that
breaks the schema must be refused with a 4xx. FUZZ_EXAMPLES sets the examples per endpoint (CI: a
few; scripts/fuzz_server.sh: many)."""
from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from lucebox.server.app import ServerConfig
from lucebox.server.protocol import INT64
from tests.server_helpers import build_model, start_server

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "10"))
# The coverage phase: each field's boundaries and wrong types, deterministic, ~2,000 cheap requests in
# all whatever EXAMPLES is (~30 s); FUZZ_COVERAGE=0 leaves it out.
COVERAGE = os.environ.get("FUZZ_COVERAGE", "1") == "1"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
# Generation is bounded so that fuzzing costs little: valid values above these are lowered (a value
# the schema refuses is left as it is, so that it is still refused).
BOUNDS = {"n": 2, "max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    srv, _, _ = start_server(build_model(tmp_path_factory.mktemp("fuzz-model")),
                             ServerConfig(keepalive=5, default_max_tokens=4), max_model_len=256)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    schema.config.phases.coverage.enabled = COVERAGE
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def bounded(body):
    if isinstance(body, dict):
        for field, cap in BOUNDS.items():
            value = body.get(field)
            if type(value) is int and 1 <= value <= INT64:
                body[field] = min(value, cap)
    return body


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_endpoint_answers_fuzzed_requests_as_documented(case):
    case.body = bounded(case.body)
    case.call_and_validate(checks=CHECKS, timeout=60)

