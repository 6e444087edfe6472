"""A relay that dies (``os._exit``) right after a target accepted a batch, before marking it delivered:
the crash the inbox's (source, event id) key must make harmless.

Run: ``python -m tests.helpers.crashing_relay ROUTES``."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import aiohttp

from dataset_bridge import relay
from dataset_bridge.routes import Routes, Target

real_post = relay.Relay._post


async def post_then_die(
    self: relay.Relay, session: aiohttp.ClientSession, target: Target, body: bytes
) -> list[dict[str, Any]]:
    results = await real_post(self, session, target, body)
    print(f"target accepted {len(results)} events; crashing before marking them", flush=True)
    os._exit(9)


relay.Relay._post = post_then_die  # type: ignore[method-assign]

if __name__ == "__main__":
    stop = asyncio.Event()
    asyncio.run(relay.run_relay(Routes.load(sys.argv[1]), relay.RelaySettings(), stop))
    sys.exit(0)
