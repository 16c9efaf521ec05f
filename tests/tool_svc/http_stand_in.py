"""Serving a small Starlette app on loopback, for stand-ins of remote HTTP services."""

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette


@contextlib.asynccontextmanager
async def serve_app(app: Starlette) -> AsyncIterator[str]:
    """Serves `app` in this loop on 127.0.0.1, on a free port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # Connections queue from now on, so the URL works before uvicorn is up.
    config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await task
        sock.close()
