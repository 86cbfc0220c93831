"""The PD block of `pdserve bench`: the router's routed-request counts, before and after.

`scrape` runs against a loopback HTTP server in a thread that answers as a router, a
--protect-health router, or a server that is not a router would.
"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from pdserve.bench.pd_routing import format_pd, parse_routed, pd_block, scrape
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import RouteMode


def router_text(pd: int = 0, decode_only: int = 0) -> str:
    """What a router's /metrics says after routing so many requests each way."""
    m = RouterMetrics()
    m.routed.labels(RouteMode.PD.value).inc(pd)
    m.routed.labels(RouteMode.DECODE_ONLY.value).inc(decode_only)
    return generate_latest(m.registry).decode()


def test_the_routers_own_exposition_parses_to_its_counts():
    assert parse_routed(router_text(pd=5, decode_only=2)) == {
        "pd": 5.0,
        "decode_only": 2.0,
        "colocated": 0.0,
    }
    assert parse_routed("# HELP x y\n# TYPE x counter\nx_total 1.0\n") is None


def test_the_block_is_the_difference_with_the_warm_up_included():
    before = {"pd": 10.0, "decode_only": 0.0, "colocated": 0.0}
    after = {"pd": 19.0, "decode_only": 3.0, "colocated": 0.0}
    block = pd_block(before, after, warmup=1)
    assert block == {
        "routed": {"pd": 9, "decode_only": 3, "colocated": 0},
        "decode_only_fraction": 0.25,
        "warmup_requests": 1,
    }
    text = format_pd(block)
    assert "requests routed pd" in text and text.splitlines()[1].endswith(" 9")
    assert "requests routed decode-only" in text and "25.0%" in text


def test_no_block_for_a_colocated_router_and_a_note_when_unreadable():
    colocated = {"pd": 0.0, "decode_only": 0.0, "colocated": 8.0}
    assert pd_block(colocated, {**colocated, "colocated": 12.0}, 1) is None
    note = pd_block("/metrics needs a key", {"pd": 1.0}, 1)
    assert note == {"note": "/metrics needs a key"}
    assert format_pd(note) == "---- PD ----\n  no PD counts: /metrics needs a key"
    # Nothing got through (all refused): the block says so rather than dividing by zero.
    idle = {"pd": 4.0, "decode_only": 0.0, "colocated": 0.0}
    block = pd_block(idle, idle, 0)
    assert block is not None and block["decode_only_fraction"] is None


class FakeServer(http.server.BaseHTTPRequestHandler):
    status = 200
    body = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        seen.append(self.headers.get("Authorization"))
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


seen: list[str | None] = []


@pytest.fixture
def server() -> Iterator[tuple[str, type[FakeServer]]]:
    handler = type("Handler", (FakeServer,), {})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_scrape_reads_a_router_and_sends_the_benchs_key(server):
    url, handler = server
    handler.body = router_text(pd=3).encode()
    seen.clear()
    assert scrape(url, {"Authorization": "Bearer k"}) == {
        "pd": 3.0,
        "decode_only": 0.0,
        "colocated": 0.0,
    }
    assert seen == ["Bearer k"]


@pytest.mark.parametrize(
    "status,body,note",
    [
        (401, b"{}", "needs a key (the router's --protect-health): pass its --api-key"),
        (404, b"not found", "answered HTTP 404"),
        (200, b"# HELP vllm:x y\n# TYPE vllm:x gauge\nvllm:x 1.0\n", "not a pdserve router"),
        (200, b"{ this is not prometheus", "is not Prometheus text"),
    ],
)
def test_scrape_says_why_there_are_no_counts(server, status, body, note):
    url, handler = server
    handler.status, handler.body = status, body
    got = scrape(url, {})
    assert isinstance(got, str) and note in got and got.startswith(url + "/metrics")


def test_scrape_of_a_port_where_nothing_listens_is_a_note():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        got = scrape(f"http://127.0.0.1:{s.getsockname()[1]}", {}, timeout_s=2.0)
    assert isinstance(got, str) and "no answer" in got
