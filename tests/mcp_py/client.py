# A run's harness written with the official Python SDK (the `mcp` package
# from PyPI): an MCP client of one server listed in $STANDBY_MCP_CONFIG,
# reached through the agent's bridge. The bridge's end-to-end tests
# (tests/tests/mcp_bridge_sdk.rs) run it as a run's command.
#
# Usage: client.py OUT SERVER NAME CAPABILITIES STEPS
# - CAPABILITIES: the capabilities it declares, comma-separated among
#   `sampling`, `roots`, `elicitation` (`-` for none); it answers each
#   with a canned answer naming NAME: sampling with "<NAME> completes:
#   <prompt>", roots with its own root file:///harness/<NAME>, elicitation
#   by accepting {"answer": "<NAME> says yes"}.
# - STEPS (JSON): a list of ["tools"] (the names `tools/list` gives),
#   ["call", tool, arguments] (the tool's text, or its error), and
#   ["roots_changed"] (sends notifications/roots/list_changed).
# Writes {"results": [...], "prompts": [...the prompts it was asked to
# sample]} to OUT once every step is done.
import json
import os
import sys
import warnings

import anyio
import mcp_types as types
from mcp import Client
from mcp.shared.exceptions import MCPError

out, server, name, capabilities, steps = sys.argv[1:6]
capabilities = set() if capabilities == "-" else set(capabilities.split(","))
steps = json.loads(steps)
prompts = []


async def sampling(context, params):
    prompt = params.messages[0].content.text
    prompts.append(prompt)
    return types.CreateMessageResult(role="assistant", model="canned",
                                     content=types.TextContent(type="text", text=f"{name} completes: {prompt}"))


async def roots(context):
    return types.ListRootsResult(roots=[types.Root(uri=f"file:///harness/{name}", name=name)])


async def elicitation(context, params):
    return types.ElicitResult(action="accept", content={"answer": f"{name} says yes"})


async def main():
    url = json.load(open(os.environ["STANDBY_MCP_CONFIG"]))["mcpServers"][server]["url"]
    callbacks = {
        "sampling_callback": sampling if "sampling" in capabilities else None,
        "list_roots_callback": roots if "roots" in capabilities else None,
        "elicitation_callback": elicitation if "elicitation" in capabilities else None,
    }
    results = []
    # The initialize handshake (the bridge's sessions), not the 2026-07-28
    # per-request envelope.
    async with Client(url, mode="legacy", client_info=types.Implementation(name=name, version="1"),
                      **callbacks) as client:
        for step in steps:
            if step[0] == "tools":
                results.append(sorted(tool.name for tool in (await client.list_tools()).tools))
            elif step[0] == "call":
                try:
                    result = await client.call_tool(step[1], step[2])
                    results.append(result.content[0].text)
                except MCPError as error:
                    results.append(f"call failed {error.error.code}: {error.error.message}")
            elif step[0] == "roots_changed":
                await client.send_roots_list_changed()
                results.append("sent")
    with open(out + ".tmp", "w") as f:
        json.dump({"results": results, "prompts": prompts}, f)
    os.rename(out + ".tmp", out)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    anyio.run(main)
