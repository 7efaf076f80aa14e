# The fake MCP server of the tests: a stdio MCP server speaking JSON-RPC by
# hand, so that it can also misbehave. The agent's MCP tests start it, and the
# end-to-end tests of the bridge (tests/tests/mcp_bridge.rs) and its benchmark
# (tests/examples/bench_mcp_bridge.rs) start it through the real agent.
#
# MODE: `silent` never answers, `refuse` answers `initialize` with an error,
# `exit` exits instead; GATE (a path) holds the `initialize` answer until it
# exists. Its tools: `env` (the value of variable `name`, empty when unset),
# `crash` (exits with status 3 mid-call), `garbage` (a line of non-JSON
# before the answer), `big` (an answer of `bytes` bytes, `id` last like
# TypeScript servers write it), `progress` (a progress notification before
# the answer), `notify` (a log message notification before the answer),
# `hang` (never answers), `ask` (sends the client a request of `method` with
# `params`, padded with `pad` bytes when given, or with `deferred` just
# before it handles the next message it reads; it answers the call with the
# JSON of the client's answer once that arrives). Notifications, answers to no request of its own, the
# capabilities it was initialized with and deferred requests are written to
# stderr.
import json, os, sys, time
def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()
mode = os.environ.get("MODE", "")
if mode == "silent":
    print("not answering on purpose", file=sys.stderr, flush=True)
    time.sleep(300)
asked = {}  # the id of a request to the client -> the id of the call it serves
questions = 0
deferred = None
for line in sys.stdin:
    message = json.loads(line)
    if deferred:
        send(deferred)
        deferred = None
    method, id = message.get("method"), message.get("id")
    params = message.get("params") or {}
    if method == "initialize":
        if mode == "refuse":
            send({"jsonrpc": "2.0", "id": id, "error": {"code": -32603, "message": "refused on purpose"}})
            continue
        if mode == "exit":
            sys.exit("exiting on purpose")
        gate = os.environ.get("GATE")
        while gate and not os.path.exists(gate):
            time.sleep(0.01)
        print("capabilities", json.dumps(params["capabilities"], sort_keys=True), file=sys.stderr, flush=True)
        send({"jsonrpc": "2.0", "id": id, "result": {"protocolVersion": params["protocolVersion"],
              "capabilities": {"tools": {}}, "serverInfo": {"name": "probe", "version": "1"}}})
    elif method == "tools/call":
        name, args = params["name"], params.get("arguments") or {}
        token = (params.get("_meta") or {}).get("progressToken")
        text = name
        if name == "env":
            text = os.environ.get(args["name"], "")
        elif name == "crash":
            os._exit(3)
        elif name == "hang":
            continue
        elif name == "ask":
            question = "q%d" % questions
            questions += 1
            asked[question] = id
            request = {"jsonrpc": "2.0", "id": question, "method": args["method"], "params": args.get("params") or {}}
            if args.get("pad"):
                request["params"]["pad"] = "x" * args["pad"]
            if args.get("deferred"):
                deferred = request
                print("deferred", question, file=sys.stderr, flush=True)
            else:
                send(request)
            continue
        elif name == "garbage":
            sys.stdout.write("this is not JSON\n")
        elif name == "big":
            body = json.dumps({"content": [{"type": "text", "text": "x" * args["bytes"]}]})
            sys.stdout.write('{"jsonrpc": "2.0", "result": ' + body + ', "id": ' + json.dumps(id) + "}\n")
            sys.stdout.flush()
            continue
        elif name == "progress":
            send({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": token, "progress": 1}})
        elif name == "notify":
            send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "hello"}})
        send({"jsonrpc": "2.0", "id": id, "result": {"content": [{"type": "text", "text": text}]}})
    elif method is None and id in asked:
        answer = message.get("result", message.get("error"))
        send({"jsonrpc": "2.0", "id": asked.pop(id), "result": {"content": [{"type": "text", "text": json.dumps(answer, sort_keys=True)}]}})
    elif method is None:
        print("answer to no request", json.dumps(id), file=sys.stderr, flush=True)
    elif method == "notifications/cancelled":
        print("cancelled", json.dumps(params), file=sys.stderr, flush=True)
    elif method is not None and id is None:
        print("notification", method, file=sys.stderr, flush=True)
    elif method is not None and id is not None:
        send({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "no such method"}})
