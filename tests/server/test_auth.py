"""Client and cluster authentication (issue 17 part 5): who may call which endpoint."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from pdserve.model.tokenizer import Tokenizer
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.server.auth import Gate, load_api_key
from tests.procs import ServerProcess, http

# Fixed keys: they name the parametrized cases, which parallel test workers must collect alike.
API_KEY = "sk-test-5e1f0c2a9b7d4e38"
CLUSTER = ClusterKey(bytes(range(7, 39)))
BEARER_API = f"Bearer {API_KEY}"
BEARER_CLUSTER = f"Bearer {CLUSTER.http_token}"


@pytest.mark.parametrize(
    ("gate", "path", "header", "allowed"),
    [
        # No key at all: everything is open (a loopback-only server).
        (Gate(), "/v1/completions", None, True),
        (Gate(), "/debug/state", None, True),
        # An API key guards /v1 and /debug, not liveness.
        (Gate(API_KEY), "/v1/completions", None, False),
        (Gate(API_KEY), "/v1/completions", "Bearer wrong-key-123", False),
        (Gate(API_KEY), "/v1/completions", API_KEY, False),  # no Bearer scheme
        (Gate(API_KEY), "/v1/completions", BEARER_API, True),
        (Gate(API_KEY), "/health", None, True),
        (Gate(API_KEY), "/metrics", None, True),
        (Gate(API_KEY), "/debug/cluster", None, False),
        (Gate(API_KEY), "/debug/cluster", BEARER_API, True),
        # --protect-health closes liveness and metrics too.
        (Gate(API_KEY, protect_health=True), "/health", None, False),
        (Gate(API_KEY, protect_health=True), "/health", BEARER_API, True),
        # The cluster key opens the cluster's endpoints, never the clients' API.
        (Gate(API_KEY, CLUSTER), "/generate", BEARER_CLUSTER, True),
        (Gate(API_KEY, CLUSTER), "/generate", None, False),
        (Gate(API_KEY, CLUSTER), "/outputs", BEARER_CLUSTER, True),  # a router's channel
        (Gate(API_KEY, CLUSTER), "/outputs", None, False),
        (Gate(None, CLUSTER), "/outputs", "Bearer wrong-key-123", False),
        (Gate(API_KEY, CLUSTER), "/v1/completions", BEARER_CLUSTER, False),
        (Gate(None, CLUSTER), "/v1/completions", None, True),  # no API key: /v1 is open
        (Gate(None, CLUSTER), "/debug/state", None, False),
        (Gate(None, CLUSTER), "/debug/state", BEARER_CLUSTER, True),
        (Gate(None, CLUSTER), "/debug/state", BEARER_API, False),
    ],
)
def test_gate(gate, path, header, allowed):
    refused = gate.refusal(path, header)
    assert (refused is None) == allowed
    if refused is not None:
        assert refused.status == 401 and refused.type == "authentication_error"


@pytest.mark.parametrize(
    ("gate", "path", "header", "routed", "allowed"),
    [
        # vLLM's client paths take the API key, as /v1 does; /ping is liveness.
        (Gate(API_KEY, CLUSTER), "/tokenize", None, True, False),
        (Gate(API_KEY, CLUSTER), "/tokenize", BEARER_CLUSTER, True, False),
        (Gate(API_KEY, CLUSTER), "/detokenize", BEARER_API, True, True),
        (Gate(API_KEY, CLUSTER), "/version", None, True, False),
        (Gate(None, CLUSTER), "/tokenize", None, True, True),
        (Gate(API_KEY, CLUSTER), "/ping", None, True, True),
        (Gate(API_KEY, protect_health=True), "/ping", None, True, False),
        # A path no route serves is a client path: its 404 for whoever may call the API.
        (Gate(), "/nowhere", None, False, True),
        (Gate(None, CLUSTER), "/nowhere", None, False, True),  # a router with no API key
        (Gate(None, CLUSTER), "/debug/nowhere", None, False, True),
        (Gate(API_KEY, CLUSTER), "/nowhere", None, False, False),
        (Gate(API_KEY, CLUSTER), "/nowhere", BEARER_CLUSTER, False, False),
        (Gate(API_KEY, CLUSTER), "/nowhere", BEARER_API, False, True),
        # A routed cluster path keeps its own rule.
        (Gate(None, CLUSTER), "/debug/state", None, True, False),
    ],
)
def test_gate_client_and_unrouted_paths(gate, path, header, routed, allowed):
    refused = gate.refusal(path, header, routed)
    assert (refused is None) == allowed
    if refused is not None:
        assert refused.status == 401 and refused.type == "authentication_error"


def test_api_key_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert load_api_key(None, None) is None
    f = tmp_path / "k"
    f.write_text("from-a-file-123\n")
    assert load_api_key(None, str(f)) == "from-a-file-123"
    monkeypatch.setenv("PDSERVE_API_KEY", "from-the-env-123")
    assert load_api_key(None, None) == "from-the-env-123"
    assert load_api_key("given-on-argv-1", None) == "given-on-argv-1"
    with pytest.raises(ValueError, match="8 characters"):
        load_api_key("short", None)


@pytest.fixture(scope="module")
def keyed_server(tiny_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("auth") / "serve.log"
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny"]
    args += ["--kv-budget-mb", "8", "--max-model-len", "512", "--api-key-file"]
    key_file = tmp_path_factory.mktemp("auth-key") / "api.key"
    key_file.write_text(API_KEY)
    with ServerProcess([*args, str(key_file)], log) as srv:
        yield srv


@pytest.mark.process
def test_a_server_with_an_api_key(keyed_server):
    url = keyed_server.url
    status, body = http("GET", url + "/v1/models", auth=False)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert http("GET", url + "/health", auth=False)[0] == 200
    assert http("GET", url + "/debug/state", auth=False)[0] == 401  # live request ids
    assert http("POST", url + "/outputs", {"channel": "c"}, auth=False)[0] == 401  # tokens
    # The run's cluster key (tests/conftest.py) opens the operator's endpoints.
    assert http("GET", url + "/debug/state")[0] == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="hello", max_tokens=3)


@pytest.mark.process
def test_a_server_with_an_api_key_guards_vllms_paths_and_unknown_ones(keyed_server, tiny_dir):
    url = keyed_server.url
    for method, path in [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version")]:
        assert http(method, url + path, {"tokens": [1]}, auth=False)[0] == 401, path
        assert http(method, url + path, {"tokens": [1]})[0] == 401, path  # the cluster key: no
    assert http("GET", url + "/ping", auth=False)[0] == 200
    assert http("POST", url + "/ping", auth=False)[0] == 200
    status, body = http("GET", url + "/no/such/path", auth=False)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"  # nothing learnt
    client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.get("/no/such/path", cast_to=object)
    ids = Tokenizer.from_dir(tiny_dir).encode("hi", add_special_tokens=False)
    got = client.post("/detokenize", body={"tokens": ids}, cast_to=object)
    assert got == {"prompt": "hi"}
