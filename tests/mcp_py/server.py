# An MCP server written with the official Python SDK (the `mcp` package from
# PyPI), speaking stdio, whose tools use what a client may offer a server:
# sampling, roots and elicitation. The bridge's end-to-end tests
# (tests/tests/mcp_bridge_sdk.rs) run it through the real agent.
#
# It checks the client's capabilities as the specification asks, like the
# official `server-everything`: `tools/list` lists `sample`, `flood` only to
# a client that declared sampling, `roots` to one that declared roots,
# `elicit` to one that declared elicitation; `echo` and `ask_unknown` always.
#
# Tools (each answers text; a failed request to the client is answered as
# "error <code>: <message>", so a test sees the code the server got):
# - `echo` {text}: the text.
# - `sample` {prompt, gate?}: with a `gate`, writes `<gate>.waiting` and waits
#   for the file `gate`; then asks the client to sample `prompt`: "sampled:
#   <the completion's text>".
# - `roots` {}: asks the client for its roots: "roots: <uri> <uri>…".
# - `elicit` {question}: asks the client for an answer: "elicited: <action>
#   <content as JSON>".
# - `flood` {count, timeout}: `count` sampling requests at once, each given
#   up after `timeout` seconds (the SDK then cancels it): a JSON object
#   counting the outcomes, by completion text or error code.
# - `ask_unknown` {}: a request of a method no client serves.
#
# A client's `notifications/roots/list_changed` is written to stderr (the
# agent keeps it in `mcp-<name>.log`) as "roots changed".
import asyncio
import json
import os
import sys
import warnings
from collections import Counter

import anyio
import mcp_types as types
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

# Sampling and roots are deprecated by the 2026-07-28 protocol, which this
# server does not speak (the bridge initializes it): they are what it is
# here to test.
warnings.simplefilter("ignore")


def tool(name, properties=None):
    schema = {"type": "object", "properties": properties or {}}
    return types.Tool(name=name, input_schema=schema)


def text(value):
    return types.CallToolResult(content=[types.TextContent(type="text", text=value)])


def failed(error):
    return f"error {error.error.code}: {error.error.message}"


async def list_tools(ctx, params):
    caps = ctx.session.client_capabilities or types.ClientCapabilities()
    tools = [tool("echo", {"text": {"type": "string"}}), tool("ask_unknown")]
    if caps.sampling is not None:
        tools += [tool("sample", {"prompt": {"type": "string"}, "gate": {"type": "string"}}),
                  tool("flood", {"count": {"type": "integer"}, "timeout": {"type": "number"}})]
    if caps.roots is not None:
        tools.append(tool("roots"))
    if caps.elicitation is not None:
        tools.append(tool("elicit", {"question": {"type": "string"}}))
    return types.ListToolsResult(tools=tools)


async def sample(session, prompt, timeout=None):
    request = types.CreateMessageRequest(params=types.CreateMessageRequestParams(
        messages=[types.SamplingMessage(role="user", content=types.TextContent(type="text", text=prompt))],
        max_tokens=16))
    result = await session.send_request(request, types.CreateMessageResult, request_read_timeout_seconds=timeout)
    return result.content.text


async def call_tool(ctx, params):
    session, args = ctx.session, params.arguments or {}
    try:
        if params.name == "echo":
            return text(args["text"])
        if params.name == "sample":
            gate = args.get("gate")
            if gate:
                with open(gate + ".waiting", "w"):
                    pass
            while gate and not os.path.exists(gate):
                await anyio.sleep(0.01)
            return text("sampled: " + await sample(session, args["prompt"]))
        if params.name == "roots":
            result = await session.send_request(types.ListRootsRequest(), types.ListRootsResult)
            return text("roots: " + " ".join(str(root.uri) for root in result.roots))
        if params.name == "elicit":
            schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
            request = types.ElicitRequest(params=types.ElicitRequestFormParams(
                message=args["question"], requested_schema=schema))
            result = await session.send_request(request, types.ElicitResult)
            return text(f"elicited: {result.action} {json.dumps(result.content, sort_keys=True)}")
        if params.name == "flood":
            async def one(index):
                try:
                    return await sample(session, f"flood {index}", args["timeout"])
                except MCPError as error:
                    return f"error {error.error.code}"
            outcomes = await asyncio.gather(*(one(index) for index in range(args["count"])))
            return text(json.dumps(Counter(outcomes), sort_keys=True))
        if params.name == "ask_unknown":
            # No typed request exists for a method no client serves: the
            # connection's raw sender is the SDK's own.
            await session._connection.outbound.send_raw_request("standby/unknown", {}, None)
            return text("answered")
    except MCPError as error:
        return text(failed(error))
    raise ValueError(f"no tool {params.name}")


async def roots_changed(ctx, params):
    print("roots changed", file=sys.stderr, flush=True)


server = Server("standby-caps", on_list_tools=list_tools, on_call_tool=call_tool,
                on_roots_list_changed=roots_changed)


async def main():
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    print("standby-caps server starting", file=sys.stderr, flush=True)
    anyio.run(main)
