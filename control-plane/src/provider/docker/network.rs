//! The sandboxes' network: a user-defined bridge with inter-container
//! traffic off, made when missing; its gateway (where containers reach the
//! server) and its bridge interface (what the firewall's rules match).

use std::collections::HashMap;
use std::net::Ipv4Addr;

use bollard::Docker;
use bollard::models::{Ipam, NetworkCreateRequest, NetworkInspect};

use super::{DockerError, NETWORK_LABEL, container};

/// The bridge driver's option that turns inter-container traffic off.
pub const ICC_OPTION: &str = "com.docker.network.bridge.enable_icc";
/// The bridge driver's option naming the bridge interface.
const BRIDGE_NAME_OPTION: &str = "com.docker.network.bridge.name";

/// What the provider needs to know of its network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Network {
    pub gateway: Ipv4Addr,
    /// The host's interface of the bridge (`br-<id>` unless named).
    pub bridge: String,
    /// Whether this server created it.
    pub made: bool,
}

/// The bridge interface of an inspected network: named by its option, or
/// the Engine's `br-` and the first 12 characters of its id.
pub fn bridge_name(inspected: &NetworkInspect) -> Option<String> {
    let options = inspected.options.as_ref();
    if let Some(name) = options.and_then(|options| options.get(BRIDGE_NAME_OPTION)) {
        return Some(name.clone());
    }
    let id = inspected.id.as_deref()?;
    Some(format!("br-{}", id.get(..12)?))
}

/// Whether the network lets containers reach each other (the Engine's
/// default: on unless the option says `false`).
fn icc_on(inspected: &NetworkInspect) -> bool {
    inspected.options.as_ref().and_then(|options| options.get(ICC_OPTION)).is_none_or(|value| value != "false")
}

/// The network, created first when missing (a bridge with inter-container
/// traffic off). An existing one must be a bridge with inter-container
/// traffic off: sandboxes on it would reach each other otherwise.
pub async fn ensure(docker: &Docker, network: &str) -> Result<Network, DockerError> {
    let error = |action| move |source| DockerError::Network { network: network.to_owned(), action, source };
    let mut made = false;
    let inspected = match docker.inspect_network(network, None).await {
        Ok(inspected) => inspected,
        Err(failure) if container::not_found(&failure) => {
            let request = NetworkCreateRequest {
                name: network.to_owned(),
                driver: Some("bridge".to_owned()),
                ipam: Some(Ipam::default()),
                options: Some(HashMap::from([(ICC_OPTION.to_owned(), "false".to_owned())])),
                labels: Some(HashMap::from([(NETWORK_LABEL.to_owned(), "sandboxes".to_owned())])),
                ..Default::default()
            };
            match docker.create_network(request).await {
                Ok(_) => {
                    made = true;
                    tracing::info!(network, "created the sandboxes' network, inter-container traffic off");
                }
                // Another server made it meanwhile.
                Err(bollard::errors::Error::DockerResponseServerError { status_code: 409, .. }) => {}
                Err(failure) => return Err(error("create")(failure)),
            }
            docker.inspect_network(network, None).await.map_err(error("inspect"))?
        }
        Err(failure) => return Err(error("inspect")(failure)),
    };
    if inspected.driver.as_deref() != Some("bridge") {
        let driver = inspected.driver.unwrap_or_default();
        return Err(DockerError::NotIsolated { network: network.to_owned(), why: format!("its driver is `{driver}`") });
    }
    if icc_on(&inspected) {
        return Err(DockerError::NotIsolated {
            network: network.to_owned(),
            why: format!("it lets containers reach each other ({ICC_OPTION} is not `false`)"),
        });
    }
    let bridge = bridge_name(&inspected).ok_or_else(|| DockerError::NoGateway { network: network.to_owned() })?;
    let gateway = inspected
        .ipam
        .and_then(|ipam| ipam.config)
        .unwrap_or_default()
        .iter()
        .find_map(|config| config.gateway.as_deref()?.parse::<Ipv4Addr>().ok())
        .ok_or_else(|| DockerError::NoGateway { network: network.to_owned() })?;
    Ok(Network { gateway, bridge, made })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inspected(id: &str, options: &[(&str, &str)]) -> NetworkInspect {
        NetworkInspect {
            id: Some(id.to_owned()),
            options: Some(options.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()),
            ..Default::default()
        }
    }

    #[test]
    fn the_bridge_is_named_by_its_option_or_by_the_network_id() {
        let id = "c836e13e94113a2420fca930bb019dda99f49a74c1c4c75c9a764a97175f8453";
        assert_eq!(bridge_name(&inspected(id, &[])).as_deref(), Some("br-c836e13e9411"));
        let named = inspected(id, &[(BRIDGE_NAME_OPTION, "sandboxes0")]);
        assert_eq!(bridge_name(&named).as_deref(), Some("sandboxes0"));
        assert_eq!(bridge_name(&inspected("short", &[])), None);
    }

    #[test]
    fn inter_container_traffic_is_on_unless_turned_off() {
        assert!(icc_on(&inspected("x", &[])));
        assert!(icc_on(&inspected("x", &[(ICC_OPTION, "true")])));
        assert!(!icc_on(&inspected("x", &[(ICC_OPTION, "false")])));
    }
}
