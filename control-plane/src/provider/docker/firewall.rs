//! What a sandbox container may reach, as netfilter rules: the decisions,
//! pure and tested here; `netfilter.rs` runs them with `iptables`.
//!
//! Three means together, each closing one way out (docs/deploy.md,
//! "Isolation"):
//! - **another sandbox**: the server makes its network with inter-container
//!   traffic off (`com.docker.network.bridge.enable_icc=false`), so the
//!   Engine itself drops traffic between two containers of one bridge; and
//!   the sandboxes' own private range is refused below like every other;
//! - **the host**: traffic from the bridge to any of the host's own
//!   addresses is delivered locally, never forwarded, so the Engine's
//!   `DOCKER-USER` chain never sees it. A chain of ours on `INPUT`
//!   (`STANDBY-IN-<bridge>`) lets through the replies to connections the
//!   host opened and TCP to the port of each server serving on the network,
//!   at the gateway address, and refuses the rest;
//! - **private ranges and metadata addresses**: a chain of ours on
//!   `DOCKER-USER` (`STANDBY-OUT-<bridge>`) for what the host forwards from
//!   the bridge: replies, the operator's allow list, DNS to the host's
//!   resolvers (the Engine's resolver asks them from inside the container),
//!   then, by `--sandbox-egress`, every non-public range refused
//!   (`public`) or everything refused (`none`).
//!
//! A refusal is a `REJECT` (ICMP port unreachable: a connect fails at once
//! with "connection refused"), never a silent drop a run would wait out.
//! IPv6: the sandboxes' network has none; a chain of ours on ip6tables'
//! `INPUT` and `DOCKER-USER` refuses whatever comes from the bridge, so a
//! link-local address reaches neither the host nor a neighbour.

use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;

use ipnet::Ipv4Net;

/// What a sandbox reaches beyond its control plane's listener
/// (`--sandbox-egress`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Egress {
    /// Public addresses only: no private, shared, loopback, link-local
    /// (metadata), multicast or reserved range, no other host address.
    #[default]
    Public,
    /// Nothing but the control plane and the allow list.
    #[value(name = "none")]
    Nothing,
    /// No rules of standby's: the sandboxes reach whatever the host's own
    /// firewall lets through (the host included). For hosts where the
    /// server cannot manage netfilter; inter-container traffic stays off.
    Unfiltered,
}

/// One entry of `--sandbox-egress-allow`: an IPv4 address or range, and
/// optionally one port (TCP and UDP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allow {
    pub net: Ipv4Net,
    pub port: Option<u16>,
}

impl FromStr for Allow {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!("`{text}` is not an allow entry ({why}): give ADDRESS[/PREFIX][:PORT], such as 10.0.0.5:5432")
        };
        let (net, port) = match text.rsplit_once(':') {
            Some((net, port)) => {
                let port: u16 = port.parse().map_err(|_| bad("the port is not a number of 1 to 65535"))?;
                if port == 0 {
                    return Err(bad("the port is not a number of 1 to 65535"));
                }
                (net, Some(port))
            }
            None => (text, None),
        };
        let net = match net.parse::<Ipv4Net>() {
            Ok(net) => net,
            Err(_) => Ipv4Net::from(net.parse::<Ipv4Addr>().map_err(|_| bad("not an IPv4 address or range"))?),
        };
        Ok(Self { net: net.trunc(), port })
    }
}

impl std::fmt::Display for Allow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.port {
            Some(port) => write!(f, "{}:{port}", self.net),
            None => write!(f, "{}", self.net),
        }
    }
}

/// The ranges `public` refuses: every IPv4 range of IANA's
/// special-purpose registry (RFC 6890) that is not globally reachable, and
/// multicast. The documentation ranges among them: some networks use them
/// as their own.
pub const NOT_PUBLIC: [&str; 14] = [
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// The firewall of one sandboxes' network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub egress: Egress,
    pub allow: Vec<Allow>,
    /// The resolvers the Engine's DNS forwards to (the host's).
    pub resolvers: Vec<Ipv4Addr>,
}

/// The names of a bridge's chains: `(STANDBY-IN-<bridge>,
/// STANDBY-OUT-<bridge>)`. A bridge name has at most 15 characters, so
/// both stay within netfilter's 28.
pub fn chains(bridge: &str) -> (String, String) {
    (format!("STANDBY-IN-{bridge}"), format!("STANDBY-OUT-{bridge}"))
}

fn args(words: &[&str]) -> Vec<String> {
    words.iter().map(|word| (*word).to_owned()).collect()
}

/// The rules a server adds to the `IN` chain while it serves on `port`:
/// TCP to that port, and the allow list's entries (a repository or a
/// service on the host itself), each tagged with the port so that the
/// server removes its own and no other's. Not bound to the gateway
/// address: an agent given `--public-url` may name another of the host's.
pub fn openings(port: u16, allow: &[Allow]) -> Vec<Vec<String>> {
    let tag = format!("standby-server {port}");
    let tagged = |mut rule: Vec<String>| {
        rule.extend(args(&["-m", "comment", "--comment", &tag, "-j", "RETURN"]));
        rule
    };
    let mut rules = vec![tagged(args(&["-p", "tcp", "--dport", &port.to_string()]))];
    for allow in allow {
        rules.extend(allow_matches(allow).into_iter().map(tagged));
    }
    rules
}

/// Whether an `iptables -S` line of the `IN` chain is a server's opening.
pub fn is_opening(line: &str) -> bool {
    line.contains("standby-server ")
}

/// The matches of an allow entry: the range, and the port over TCP and UDP.
fn allow_matches(allow: &Allow) -> Vec<Vec<String>> {
    let net = allow.net.to_string();
    match allow.port {
        None => vec![args(&["-d", &net])],
        Some(port) => ["tcp", "udp"]
            .into_iter()
            .map(|protocol| args(&["-d", &net, "-p", protocol, "--dport", &port.to_string()]))
            .collect(),
    }
}

const REJECT: [&str; 2] = ["-j", "REJECT"];

fn replies() -> Vec<String> {
    args(&["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"])
}

/// The `IN` chain's own rules: replies pass, the rest is refused. Each
/// server's [`openings`] go before the refusal.
pub fn input_rules() -> Vec<Vec<String>> {
    vec![replies(), args(&REJECT)]
}

/// The `OUT` chain's rules for `policy`, in order; an empty list for
/// [`Egress::Unfiltered`] (no chain at all).
pub fn output_rules(policy: &Policy) -> Vec<Vec<String>> {
    if policy.egress == Egress::Unfiltered {
        return Vec::new();
    }
    let mut rules = vec![replies()];
    for allow in &policy.allow {
        rules.extend(allow_matches(allow).into_iter().map(|mut rule| {
            rule.extend(args(&["-j", "RETURN"]));
            rule
        }));
    }
    for resolver in &policy.resolvers {
        let resolver = format!("{resolver}/32");
        for protocol in ["udp", "tcp"] {
            rules.push(args(&["-d", &resolver, "-p", protocol, "--dport", "53", "-j", "RETURN"]));
        }
    }
    match policy.egress {
        Egress::Public => {
            for range in NOT_PUBLIC {
                rules.push(args(&["-d", range, "-j", "REJECT"]));
            }
        }
        Egress::Nothing => rules.push(args(&REJECT)),
        Egress::Unfiltered => unreachable!("returned above"),
    }
    rules
}

/// The IPv6 chains' one rule (both chains): replies pass, nothing else
/// from the bridge does.
pub fn ipv6_rules() -> Vec<Vec<String>> {
    vec![replies(), args(&REJECT)]
}

/// The resolvers named in a `resolv.conf`: its IPv4 `nameserver` lines.
/// Loopback ones are left out: the Engine asks those from the host itself,
/// not from the container.
pub fn resolvers(resolv_conf: &str) -> Vec<Ipv4Addr> {
    resolv_conf
        .lines()
        .filter_map(|line| line.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<IpAddr>().ok())
        .filter_map(|address| match address {
            IpAddr::V4(v4) if !v4.is_loopback() => Some(v4),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(egress: Egress, allow: &[&str]) -> Policy {
        let allow = allow.iter().map(|entry| entry.parse().expect("an allow entry")).collect();
        Policy { egress, allow, resolvers: vec![Ipv4Addr::new(10, 0, 0, 2)] }
    }

    /// Whether `address` lies outside every range of [`NOT_PUBLIC`].
    fn is_public(address: Ipv4Addr) -> bool {
        !NOT_PUBLIC.iter().any(|range| range.parse::<Ipv4Net>().is_ok_and(|net| net.contains(&address)))
    }

    fn joined(rules: &[Vec<String>]) -> Vec<String> {
        rules.iter().map(|rule| rule.join(" ")).collect()
    }

    #[test]
    fn allow_entries_are_an_address_or_range_with_an_optional_port() {
        let entry: Allow = "10.1.2.3".parse().expect("an address");
        assert_eq!(entry.to_string(), "10.1.2.3/32");
        let entry: Allow = "10.1.2.3/16:5432".parse().expect("a range and a port");
        assert_eq!((entry.net.to_string(), entry.port), ("10.1.0.0/16".to_owned(), Some(5432)));
        for bad in ["", "10.1.2", "10.1.2.3:0", "10.1.2.3:99999", "::1", "10.0.0.0/33", "host:80"] {
            let error = bad.parse::<Allow>().expect_err(bad);
            assert!(error.contains(&format!("`{bad}`")), "{error}");
        }
    }

    #[test]
    fn public_refuses_every_non_public_range_after_replies_the_allow_list_and_dns() {
        let rules = joined(&output_rules(&policy(Egress::Public, &["10.9.0.0/16:443"])));
        assert_eq!(rules[0], "-m conntrack --ctstate ESTABLISHED,RELATED -j RETURN");
        assert_eq!(rules[1], "-d 10.9.0.0/16 -p tcp --dport 443 -j RETURN");
        assert_eq!(rules[2], "-d 10.9.0.0/16 -p udp --dport 443 -j RETURN");
        assert_eq!(rules[3], "-d 10.0.0.2/32 -p udp --dport 53 -j RETURN");
        assert_eq!(rules[4], "-d 10.0.0.2/32 -p tcp --dport 53 -j RETURN");
        let refused: Vec<&str> = rules[5..].iter().map(String::as_str).collect();
        assert_eq!(refused.len(), NOT_PUBLIC.len());
        assert!(refused.contains(&"-d 169.254.0.0/16 -j REJECT"), "the metadata address");
        assert!(refused.contains(&"-d 172.16.0.0/12 -j REJECT"), "the Engine's networks");
        assert!(rules.last().is_some_and(|last| last.ends_with("-j REJECT")), "nothing after the refusals");
    }

    #[test]
    fn none_refuses_all_but_replies_the_allow_list_and_dns() {
        let rules = joined(&output_rules(&policy(Egress::Nothing, &["198.51.100.7"])));
        assert_eq!(rules[1], "-d 198.51.100.7/32 -j RETURN");
        assert_eq!(rules.last().map(String::as_str), Some("-j REJECT"));
        assert_eq!(rules.len(), 5);
    }

    #[test]
    fn unfiltered_has_no_rules() {
        assert!(output_rules(&policy(Egress::Unfiltered, &["10.0.0.1"])).is_empty());
    }

    #[test]
    fn the_input_chain_refuses_all_but_replies_and_each_servers_openings() {
        assert_eq!(joined(&input_rules()), ["-m conntrack --ctstate ESTABLISHED,RELATED -j RETURN", "-j REJECT"]);
        let allow = ["172.30.0.1:9418".parse().expect("an entry")];
        assert_eq!(
            joined(&openings(8080, &allow)),
            [
                "-p tcp --dport 8080 -m comment --comment standby-server 8080 -j RETURN",
                "-d 172.30.0.1/32 -p tcp --dport 9418 -m comment --comment standby-server 8080 -j RETURN",
                "-d 172.30.0.1/32 -p udp --dport 9418 -m comment --comment standby-server 8080 -j RETURN",
            ]
        );
        assert!(is_opening(
            "-A STANDBY-IN-br-1 -p tcp -m tcp --dport 8080 -m comment --comment \"standby-server 8080\" -j RETURN"
        ));
        assert!(!is_opening("-A STANDBY-IN-br-1 -j REJECT --reject-with icmp-port-unreachable"));
    }

    #[test]
    fn chain_names_fit_netfilter() {
        let (input, output) = chains("br-0123456789ab");
        assert_eq!((input.as_str(), output.as_str()), ("STANDBY-IN-br-0123456789ab", "STANDBY-OUT-br-0123456789ab"));
        assert!(output.len() <= 28);
    }

    #[test]
    fn resolvers_are_the_non_loopback_ipv4_nameservers() {
        let conf =
            "# comment\nnameserver 127.0.0.53\nnameserver 10.0.0.2\nnameserver fd00::1\nsearch x\nnameserver 1.1.1.1\n";
        assert_eq!(resolvers(conf), [Ipv4Addr::new(10, 0, 0, 2), Ipv4Addr::new(1, 1, 1, 1)]);
    }

    #[test]
    fn public_means_outside_every_special_purpose_range() {
        for private in ["10.1.1.1", "172.17.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "127.0.0.1"] {
            assert!(!is_public(private.parse().expect("an address")), "{private}");
        }
        for private in ["192.0.2.2", "198.51.100.7", "203.0.113.9", "255.255.255.255", "224.0.0.1"] {
            assert!(!is_public(private.parse().expect("an address")), "{private}");
        }
        for public in ["1.1.1.1", "11.22.33.44", "8.8.8.8", "172.32.0.1", "100.128.0.1"] {
            assert!(is_public(public.parse().expect("an address")), "{public}");
        }
    }
}
