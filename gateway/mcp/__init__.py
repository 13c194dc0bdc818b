"""The agent-side MCP server (``uomp mcp serve``): the agent SDK under an MCP server, so any MCP
client reaches exactly what the user granted (:mod:`gateway.mcp.server`, :mod:`gateway.mcp.tools`).
Needs the ``mcp`` extra (``pip install 'uomp-gateway[mcp]'``)."""
