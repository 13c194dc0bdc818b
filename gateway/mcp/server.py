"""``uomp mcp serve``: the agent's side of UOMP as a Model Context Protocol server (the official
``mcp`` Python SDK, low-level server), over stdio or streamable HTTP on a loopback address.

Under it is the agent SDK (:class:`gateway.client.UompClient`) on the agent's bundle: mTLS (or DPoP
through a tunnel, or the Local Profile's bearer token), token refresh and certificate renewal. So
the MCP client reaches exactly what the user granted this agent, and the gateway decides every call.

* Tools (:mod:`gateway.mcp.tools`): each call's arguments are checked against its input schema; the
  answer is the gateway's JSON (text and ``structuredContent``). A refusal, by the gateway or by
  the schema, is a tool error (``isError: true``) whose text is ``CODE: reason`` and whose
  structured content is ``{"error": {"code", "message"}}``; nothing a tool call does ends the server.
* Resources: ``uomp://grant`` (the grant in words and as JSON) and ``uomp://tag/<tag>`` for each
  granted tag (the first page of that tag; one read query each time it is read).
* Logs go to stderr (stdout is the stdio transport). They name the tool and the outcome's code,
  never an argument, a token, a key or a memory value; the MCP SDK's own loggers are kept at
  WARNING, since at DEBUG they print every message, and a filter removes this client's tokens
  from any record that might still carry one.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import quote, unquote

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS

from gateway import __version__
from gateway.client.errors import UompClientError
from gateway.mcp.tools import TOOLS, Agent, ArgumentError, check_arguments

log = logging.getLogger("uomp.mcp")

GRANT_URI = "uomp://grant"
TAG_PREFIX = "uomp://tag/"
QUIET_LOGGERS = ("mcp", "mcp_types", "httpx", "httpx2", "httpcore", "uvicorn", "uvicorn.access", "sse_starlette")
INSTRUCTIONS = (
    "Tools to read the user's memory that the user granted this agent through UOMP (user-owned, "
    "scoped, revocable, audited). Call grant_describe first to see what may be read. A refusal is a "
    "tool error 'CODE: reason'; SESSION_REVOKED means the user ended the session."
)


class SecretFilter(logging.Filter):
    """Replaces the client's tokens (current and recent) in any log record with ``[redacted]``."""

    def __init__(self, agent: Agent) -> None:
        super().__init__()
        self.agent = agent

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        clean = self.agent.client.scrub(text)  # the SDK's own live and recent tokens
        if clean != text:
            record.msg, record.args = clean, None
        return True


def quiet_logging(agent: Agent) -> None:
    """Keeps the MCP SDK's loggers at WARNING and filters this agent's secrets out of every log line."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(SecretFilter(agent))


def _text(doc: Any) -> str:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


def tool_error(code: str, message: str) -> types.CallToolResult:
    """An MCP tool error carrying our stable code and the one-line reason."""
    return types.CallToolResult(
        content=[types.TextContent(text=f"{code}: {message}")],
        structured_content={"error": {"code": code, "message": message}},
        is_error=True,
    )


def build_server(agent: Agent) -> Server[Any]:
    """The MCP server of one agent bundle."""

    async def list_tools(ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None) -> Any:
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=t.name,
                    title=t.title,
                    description=t.description,
                    input_schema=t.input_schema,
                    annotations=types.ToolAnnotations(
                        title=t.title,
                        read_only_hint=t.read_only,
                        destructive_hint=t.name == "session_end",
                        open_world_hint=False,
                    ),
                )
                for t in TOOLS
            ]
        )

    async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> Any:
        name = params.name
        try:
            args = check_arguments(name, params.arguments)
            answer = await agent.call(name, args)
        except ArgumentError as exc:
            log.info("tool %s refused: INVALID_REQUEST (arguments)", name[:64])
            return tool_error("INVALID_REQUEST", str(exc))
        except UompClientError as exc:
            log.info("tool %s refused: %s", name, exc.code)
            return tool_error(exc.code, exc.message)
        except Exception as exc:  # a tool call never ends the server; internals are not shown
            log.error("tool %s failed: %s", name, type(exc).__name__)
            return tool_error("INTERNAL", "the MCP server failed on this call; run it with -v and report it")
        log.info("tool %s answered", name)
        return types.CallToolResult(content=[types.TextContent(text=_text(answer))], structured_content=answer)

    async def list_resources(ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None) -> Any:
        resources = [
            types.Resource(
                uri=GRANT_URI,
                name="grant",
                title="What this agent may read",
                description="The grant in words, the session's own view and the token's limits",
                mime_type="application/json",
            )
        ]
        for tag in agent.granted_tags():
            resources.append(
                types.Resource(
                    uri=TAG_PREFIX + quote(tag, safe=""),
                    name=f"tag:{tag}",
                    title=f"Items tagged {tag}",
                    description="The first page of the granted items with this tag (one read query)",
                    mime_type="application/json",
                )
            )
        return types.ListResourcesResult(resources=resources)

    async def read_resource(ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams) -> Any:
        uri = str(params.uri)
        try:
            if uri == GRANT_URI:
                doc: Any = await agent.grant()
            elif uri.startswith(TAG_PREFIX) and unquote(uri[len(TAG_PREFIX) :]) in agent.granted_tags():
                items, nxt = await agent.client.by_tag_page(unquote(uri[len(TAG_PREFIX) :]))
                agent.remember(items)
                doc = {"items": items, "next_cursor": nxt}
            else:
                raise MCPError(INVALID_PARAMS, "no such resource: the resources are uomp://grant and the granted tags")
        except UompClientError as exc:
            log.info("resource refused: %s", exc.code)
            raise MCPError(INVALID_PARAMS, f"{exc.code}: {exc.message}", {"code": exc.code}) from None
        except MCPError:
            raise
        except Exception as exc:
            log.error("resource failed: %s", type(exc).__name__)
            raise MCPError(INTERNAL_ERROR, "the MCP server failed on this read") from None
        return types.ReadResourceResult(
            contents=[types.TextResourceContents(uri=uri, mime_type="application/json", text=_text(doc))]
        )

    return Server(
        "uomp",
        version=__version__,
        title="UOMP memory",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_read_resource=read_resource,
    )


@contextlib.asynccontextmanager
async def opened(agent: Agent) -> AsyncIterator[Server[Any]]:
    """The MCP server over the agent's open SDK client (closed on exit)."""
    quiet_logging(agent)
    async with agent.client:
        yield build_server(agent)


async def serve_stdio(agent: Agent) -> None:
    """Serves MCP on stdin/stdout until the client goes away."""
    async with opened(agent) as server, stdio_server() as (read, write):
        log.info("serving MCP on stdio for session %s", agent.client.session_id)
        await server.run(read, write, server.create_initialization_options())


def loopback_host(host: str) -> str:
    """``host`` if it is a loopback address (127.0.0.0/8, ::1) or ``localhost``; else ValueError."""
    if host == "localhost":
        return host
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return host.strip("[]")
    except ValueError:
        pass
    raise ValueError(f"--http binds loopback only (127.0.0.1, ::1, localhost), not {host!r}")


ASGI = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]
UNAUTHORIZED_BODY = (
    b'{"error":{"code":"UNAUTHORIZED","message":"this MCP server needs Authorization: Bearer '
    b'<the contents of its --http-token-file>"}}'
)


def bearer_gate(app: ASGI, token: str) -> ASGI:
    """``app`` behind ``Authorization: Bearer <token>`` (compared in constant time): a local process
    that does not hold the token file gets 401 and never reaches a tool."""
    want = b"Bearer " + token.encode()

    async def gate(
        scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope.get("type") == "http":
            got = b""
            for name, value in scope.get("headers") or ():
                if name.lower() == b"authorization":
                    got = value
            if not hmac.compare_digest(got, want):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"www-authenticate", b'Bearer realm="uomp-mcp"'),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": UNAUTHORIZED_BODY})
                return
        await app(scope, receive, send)

    return gate


async def serve_http(agent: Agent, host: str, port: int, *, token: str | None = None) -> None:
    """Streamable HTTP at ``http://HOST:PORT/mcp`` (loopback only; DNS-rebinding protection on;
    with ``token``, every request needs ``Authorization: Bearer <token>``)."""
    import uvicorn

    host = loopback_host(host)
    async with opened(agent) as server:
        app: Any = server.streamable_http_app(host=host)
        if token is not None:
            app = bearer_gate(app, token)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on")
        log.info("serving MCP on http://%s:%d/mcp for session %s", host, port, agent.client.session_id)
        await uvicorn.Server(config).serve()
