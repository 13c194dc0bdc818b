"""Pure logic: no aiohttp, asyncio, sqlite or socket imports (tested as bytes in, objects out)."""
