"""Async triggers (asyncpg, aiohttp) and the identity contract: what a trigger waits on."""
