"""A decode-side NIXL peer in its own process, for the nixl conformance tests.

It registers a shared-memory KV pool of the given layout (argv: the layout's descriptor as
JSON, the page count, a tag) with a NIXL agent, prints one JSON line (its pool path
and its NIXL descriptor, hex-encoded), then answers stdin commands: `landed` prints the
notifications that arrived since the last `landed` as JSON, `quit` exits. The test maps the
same pool to check bytes.
"""

from __future__ import annotations

import dataclasses
import json
import select
import sys

import torch

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool
from pdserve.runtime.timing import ROLE_POLL_S
from pdserve.transfer.nixl import NixlAgent


def main() -> None:
    layout, num_pages = KVLayout.from_dict(json.loads(sys.argv[1])), int(sys.argv[2])
    pool = KVPool(layout, num_pages, torch.device("cpu"), shared=True)
    agent = NixlAgent(f"peer-{sys.argv[3]}", pool)
    d = agent.descriptor()
    print(
        "PEER "
        + json.dumps(
            {
                "shm": dataclasses.asdict(pool.shm),
                "md": d.agent_md.hex(),
                "base": d.base,
                "device_id": d.device_id,
                "mem": d.mem,
            }
        ),
        flush=True,
    )
    landed: list[tuple[int, int, int]] = []
    while True:
        # Like a decode engine with rooms open: drain notifications (this also drives UCX,
        # which has no progress thread of its own) every ROLE_POLL_S between commands.
        landed += agent.landed()
        if not select.select([sys.stdin], [], [], ROLE_POLL_S)[0]:
            continue
        line = sys.stdin.readline()
        cmd = line.strip()
        if cmd == "landed":
            print("PEER " + json.dumps(landed), flush=True)
            landed = []
        elif cmd == "quit" or not line:  # quit, or the test went away (EOF)
            return


if __name__ == "__main__":
    main()
