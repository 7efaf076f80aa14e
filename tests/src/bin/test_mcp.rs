//! `standby-test-mcp`: a small MCP server on stdio, built with the official
//! SDK (rmcp), that the agent starts as a `transport: "stdio"` server in the
//! bridge's end-to-end tests and benchmark.
//!
//! Tools:
//! - `env` (`{"name": "VAR"}`): the value of the environment variable `VAR`
//!   (empty when unset), so a test sees which environment the agent gave
//!   the server;
//! - `crash`: exits with status 3 in the middle of the call.

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::json;

struct Probe;

fn tool(name: &'static str, description: &'static str, schema: serde_json::Value) -> Tool {
    let serde_json::Value::Object(schema) = schema else { unreachable!("every schema here is an object") };
    Tool::new(name, description, schema)
}

impl ServerHandler for Probe {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("standby-test-mcp", env!("CARGO_PKG_VERSION")))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![
            tool(
                "env",
                "The value of an environment variable of the server",
                json!({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}),
            ),
            tool("crash", "Exits the server in the middle of the call", json!({"type": "object"})),
        ]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        match request.name.as_ref() {
            "env" => {
                let name = request
                    .arguments
                    .as_ref()
                    .and_then(|arguments| arguments.get("name"))
                    .and_then(serde_json::Value::as_str)
                    .ok_or_else(|| ErrorData::invalid_params("`name` (a string) is required", None))?;
                let value = std::env::var(name).unwrap_or_default();
                Ok(CallToolResult::success(vec![ContentBlock::text(value)]).into())
            }
            "crash" => std::process::exit(3),
            other => Err(ErrorData::invalid_params(format!("no tool named {other:?}"), None)),
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = Probe.serve(rmcp::transport::stdio()).await?;
    server.waiting().await?;
    Ok(())
}
