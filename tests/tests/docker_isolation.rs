//! Tenants isolated on Docker, tried on real containers the way a run's
//! command would try (docs/deploy.md, "Isolation"): from inside sandbox
//! containers made by a real server, TCP connections to another sandbox,
//! to the host's other ports, to the server, and to a stand-in of the
//! outside world.
//!
//! The outside world is a network namespace of the test's own behind a
//! veth pair, routed from the host: it holds a public address
//! (11.22.33.44, routed to the namespace for the test's length: it stands
//! in for the internet),
//! a private one (10.253.7.2) and the cloud metadata address
//! (169.254.169.254), with one listener answering on all three. Without
//! the server's rules every one of them answers a container (the Engine
//! forwards and masquerades to any route of the host).
//!
//! The probes run as the sandbox's user with `docker exec`, in the
//! container's own network namespace: what a run's command can reach.
//! Under `CI=true` the tests fail when no engine answers; elsewhere they
//! are skipped, loudly. They need root (the namespace, the firewall).

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};

use nix::sys::signal::Signal;
use standby_e2e::docker::{self, Server, bridge, firewall_rules};

/// What a connection from a sandbox came to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Probe {
    /// Connected; what the peer sent first.
    Reached(String),
    /// Refused at once (a REJECT, or nothing listening).
    Refused,
    /// Neither within the probe's 10 s.
    TimedOut,
    Other(String),
}

/// Connects from the sandbox's container to `ip:port`, sends `send`, and
/// reads what comes back.
///
/// Under gVisor (Debian's `runsc` of 2022-12-19, its network stack off) a
/// blocking read of a connected socket was seen to fail once with `EAGAIN`
/// in a loaded run of the whole suite: the connection was made, so the
/// firewall let it through, and the probe is made again (at most twice).
fn probe(sandbox: &str, ip: &str, port: u16, send: &str) -> Probe {
    let mut reply = probe_once(sandbox, ip, port, send);
    for _ in 0..2 {
        match &reply {
            Probe::Other(text) if text.contains("Resource temporarily unavailable") => {
                reply = probe_once(sandbox, ip, port, send);
            }
            _ => break,
        }
    }
    reply
}

fn probe_once(sandbox: &str, ip: &str, port: u16, send: &str) -> Probe {
    let script = format!(
        "timeout 10 bash -c 'exec 3<>/dev/tcp/{ip}/{port} || exit 7; printf \"{send}\" >&3; timeout 5 head -c 200 <&3'"
    );
    let output = Command::new("docker")
        .args(["exec", &format!("standby-{sandbox}"), "bash", "-c", &script])
        .output()
        .expect("run docker exec");
    let (stdout, stderr) =
        (String::from_utf8_lossy(&output.stdout).into_owned(), String::from_utf8_lossy(&output.stderr).into_owned());
    match output.status.code() {
        Some(0) if !stdout.is_empty() => Probe::Reached(stdout),
        Some(124) => Probe::TimedOut,
        _ if stderr.contains("Connection refused") => Probe::Refused,
        code => Probe::Other(format!("exit {code:?}: {stdout}{stderr}")),
    }
}

/// Asserts that a probe from `sandbox` to `ip:port` is refused; otherwise
/// fails naming `what` with the host's firewall as it stood (the jumps of
/// `FORWARD`, `DOCKER-USER` and `INPUT`, and the chains of the sandbox's
/// network), so that a leak shows which rule was missing.
fn assert_refused(sandbox: &str, ip: &str, port: u16, what: &str) {
    let reply = probe(sandbox, ip, port, "");
    if reply != Probe::Refused {
        let network = docker::inspect(sandbox, "{{range $name, $_ := .NetworkSettings.Networks}}{{$name}}{{end}}");
        let bridge = network.as_deref().and_then(bridge).unwrap_or_default();
        let listed = |args: &[&str]| {
            let output = Command::new("iptables").arg("-w").args(args).output().expect("run iptables");
            String::from_utf8_lossy(&output.stdout).into_owned()
        };
        let hooks = ["FORWARD", "DOCKER-USER", "INPUT"].map(|chain| listed(&["-S", chain])).join("");
        let ours = firewall_rules("iptables", &bridge).join("\n");
        panic!("{what}: {reply:?}, not refused; the hooks:\n{hooks}the rules naming {bridge:?}:\n{ours}");
    }
}

/// A container's address on its network.
fn address(sandbox: &str) -> String {
    docker::inspect(sandbox, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}").expect("an address")
}

fn gateway(network: &str) -> String {
    docker::docker(&["network", "inspect", "--format", "{{(index .IPAM.Config 0).Gateway}}", network])
        .expect("the network's gateway")
}

/// A listener on the host, on every address, answering `host-listener`.
fn host_listener() -> u16 {
    let listener = TcpListener::bind("0.0.0.0:0").expect("bind a host listener");
    let port = listener.local_addr().expect("an address").port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let _ = stream.write_all(b"host-listener\n");
        }
    });
    port
}

/// One of the host's IPv4 addresses other than `gateway` (its own network
/// interface's, or another bridge's).
fn other_host_address(gateway: &str) -> String {
    let output = Command::new("ip").args(["-4", "-o", "addr", "show", "scope", "global"]).output().expect("run ip");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.lines()
        .filter_map(|line| line.split_whitespace().nth(3)?.split('/').next().map(str::to_owned))
        .find(|address| address != gateway)
        .expect("a host address besides the gateway")
}

fn run(command: &str, args: &[&str]) {
    let output = Command::new(command).args(args).output().expect("run a command");
    assert!(output.status.success(), "{command} {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
}

const PUBLIC: &str = "11.22.33.44";
const PRIVATE: &str = "10.253.7.2";
const METADATA: &str = "169.254.169.254";

/// The stand-in of the outside world: a namespace behind a veth pair, its
/// addresses routed from the host, and a listener answering with the
/// address it was reached at. Removed when dropped. One at a time on a
/// machine (its addresses and routes are fixed): it holds a lock file.
struct World {
    _one_at_a_time: std::fs::File,
    namespace: String,
    host_end: String,
    listener: Child,
    port: u16,
}

impl World {
    fn start() -> Self {
        let lock = std::env::temp_dir().join("standby-e2e-world.lock");
        let one_at_a_time = std::fs::File::create(&lock).expect("create the world's lock file");
        one_at_a_time.lock().expect("lock the world");
        let tag = std::process::id() % 100_000;
        let (namespace, host_end, inner_end) =
            (format!("standby-world-{tag}"), format!("sbw{tag}h"), format!("sbw{tag}n"));
        let _ = Command::new("ip").args(["netns", "del", &namespace]).output();
        run("ip", &["netns", "add", &namespace]);
        run("ip", &["link", "add", &host_end, "type", "veth", "peer", "name", &inner_end]);
        run("ip", &["link", "set", &inner_end, "netns", &namespace]);
        run("ip", &["addr", "add", "10.253.7.1/30", "dev", &host_end]);
        run("ip", &["link", "set", &host_end, "up"]);
        for routed in [PUBLIC, METADATA] {
            run("ip", &["route", "add", &format!("{routed}/32"), "dev", &host_end]);
        }
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", namespace.as_str()];
            all.extend_from_slice(args);
            run("ip", &all);
        };
        inside(&["ip", "link", "set", "lo", "up"]);
        inside(&["ip", "addr", "add", &format!("{PRIVATE}/30"), "dev", &inner_end]);
        for extra in [PUBLIC, METADATA] {
            inside(&["ip", "addr", "add", &format!("{extra}/32"), "dev", &inner_end]);
        }
        inside(&["ip", "link", "set", &inner_end, "up"]);
        inside(&["ip", "route", "add", "default", "via", "10.253.7.1"]);
        let script = "import socket,sys\n\
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 0)); s.listen(16)\n\
print(s.getsockname()[1], flush=True)\n\
while True:\n    c,_=s.accept(); c.sendall(('world '+c.getsockname()[0]+'\\n').encode()); c.close()\n";
        let mut listener = Command::new("ip")
            .args(["netns", "exec", &namespace, "python3", "-c", script])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the world's listener");
        let mut line = Vec::new();
        let mut stdout = listener.stdout.take().expect("its stdout");
        let mut byte = [0u8; 1];
        while stdout.read(&mut byte).expect("read its port") == 1 && byte[0] != b'\n' {
            line.push(byte[0]);
        }
        let port = String::from_utf8_lossy(&line).trim().parse().expect("the listener's port");
        Self { _one_at_a_time: one_at_a_time, namespace, host_end, listener, port }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = self.listener.kill();
        let _ = self.listener.wait();
        let _ = Command::new("ip").args(["link", "del", &self.host_end]).output();
        let _ = Command::new("ip").args(["netns", "del", &self.namespace]).output();
    }
}

fn reached_at(probe: &Probe, address: &str) -> bool {
    matches!(probe, Probe::Reached(reply) if reply.trim() == format!("world {address}"))
}

/// `--sandbox-runtime runsc`: the same tests under gVisor, whose own
/// network stack is off (`--network=host` in its registration: the
/// container's namespace and the host's rules see its traffic).
const UNDER_GVISOR: [&str; 2] = ["--sandbox-runtime", docker::GVISOR];

#[tokio::test]
async fn sandboxes_reach_their_server_but_not_each_other_nor_the_hosts_other_ports() {
    if docker::available("isolation: neighbours and the host") {
        neighbours_and_the_host(&[]).await;
    }
}

#[tokio::test]
async fn under_gvisor_sandboxes_reach_their_server_but_not_each_other_nor_the_hosts_other_ports() {
    if docker::gvisor_available("isolation under gVisor: neighbours and the host") {
        neighbours_and_the_host(&UNDER_GVISOR).await;
    }
}

#[tokio::test]
async fn public_reaches_the_outside_world_only_and_none_reaches_only_the_allow_list() {
    if docker::available("isolation: egress") {
        egress(&[]).await;
    }
}

#[tokio::test]
async fn under_gvisor_public_reaches_the_outside_world_only_and_none_reaches_only_the_allow_list() {
    if docker::gvisor_available("isolation under gVisor: egress") {
        egress(&UNDER_GVISOR).await;
    }
}

/// Two sandboxes of a server started with `runtime` (more flags): not
/// each other, not the host's other ports, their server yes, and the
/// server's chains gone after its clean stop.
async fn neighbours_and_the_host(runtime: &[&str]) {
    let mut args = vec!["--pool-size", "2"];
    args.extend_from_slice(runtime);
    let mut server = Server::start_on(&docker::image(), &args).await;
    let first = server.ready_standby().await;
    let second = server
        .until("a second ready standby", async || {
            let sandboxes = server.sandboxes().await;
            let ready = sandboxes.iter().filter(|s| s["candidate"] == true && s["id"] != first.as_str());
            ready.filter_map(|s| s["id"].as_str().map(str::to_owned)).next()
        })
        .await;
    let network = server.cleanup.network.clone();
    let at_gateway = gateway(&network);

    // A run in the first sandbox listens; it reaches itself.
    let listen = "perl -MIO::Socket::INET -e '$s=IO::Socket::INET->new(LocalPort=>7000,Listen=>5,ReuseAddr=>1) or die; \
                  while($c=$s->accept){print $c \"neighbour\\n\"; close $c}'";
    docker::docker(&["exec", "-d", &format!("standby-{first}"), "sh", "-c", listen]).expect("start the listener");
    server
        .until("the first sandbox's listener answers inside it", async || {
            matches!(probe(&first, "127.0.0.1", 7000, ""), Probe::Reached(_)).then_some(())
        })
        .await;
    assert_refused(&second, &address(&first), 7000, "another sandbox's port");

    // The server, at the gateway: reached.
    let port = server.addr().port();
    let reply = probe(&first, &at_gateway, port, "GET /healthz HTTP/1.0\\r\\n\\r\\n");
    assert!(matches!(&reply, Probe::Reached(text) if text.starts_with("HTTP/1.0 200")), "the server: {reply:?}");

    // Any other port of the host, at this gateway or another of its
    // addresses (the default bridge's): refused.
    let host_port = host_listener();
    assert_refused(&first, &at_gateway, host_port, "a host port at the gateway");
    let other = other_host_address(&at_gateway);
    assert_refused(&first, &other, host_port, &format!("a host port at the host's {other}"));

    // The server's chains are in place while it serves, and gone after its
    // clean stop.
    let bridge = bridge(&network).expect("the network's bridge");
    let rules = firewall_rules("iptables", &bridge);
    for chain in [format!("-N STANDBY-IN-{bridge}"), format!("-N STANDBY-OUT-{bridge}")] {
        assert!(rules.contains(&chain), "{chain} in {rules:#?}");
    }
    let status = server.process.take().expect("the server runs").stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status}");
    let ours = |program| -> Vec<String> {
        firewall_rules(program, &bridge).into_iter().filter(|line| line.contains("STANDBY-")).collect()
    };
    assert_eq!(ours("iptables"), Vec::<String>::new(), "no IPv4 rule of the server's left");
    assert_eq!(ours("ip6tables"), Vec::<String>::new(), "no IPv6 rule of the server's left");
}

/// Under `public` the outside world's public address only; under `none`
/// with one address and port allowed, that one only.
async fn egress(runtime: &[&str]) {
    let world = World::start();
    let port = world.port;

    let mut args = vec!["--pool-size", "1"];
    args.extend_from_slice(runtime);
    let mut server = Server::start_on(&docker::image(), &args).await;
    let sandbox = server.ready_standby().await;
    let public = probe(&sandbox, PUBLIC, port, "");
    assert!(reached_at(&public, PUBLIC), "public: the public stand-in is reached: {public:?}");
    assert_refused(&sandbox, PRIVATE, port, "public: a private address");
    assert_refused(&sandbox, METADATA, port, "public: the metadata address");
    let status = server.process.take().expect("the server runs").stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status}");

    let allow = format!("{PRIVATE}:{port}");
    let mut args = vec!["--pool-size", "1", "--sandbox-egress", "none", "--sandbox-egress-allow", &allow];
    args.extend_from_slice(runtime);
    let server = Server::start_on(&docker::image(), &args).await;
    let sandbox = server.ready_standby().await;
    assert_refused(&sandbox, PUBLIC, port, "none: the public stand-in");
    let private = probe(&sandbox, PRIVATE, port, "");
    assert!(reached_at(&private, PRIVATE), "none: the allowed address is reached: {private:?}");
    assert_refused(&sandbox, PRIVATE, port + 1, "none: the allowed address, another port");
    assert_refused(&sandbox, METADATA, port, "none: the metadata address");
    server.stop().await;
    drop(world);
}

#[tokio::test]
async fn a_network_where_containers_reach_each_other_is_refused_naming_it() {
    if !docker::available("isolation: an open network") {
        return;
    }
    let network = format!("standby-e2e-open-{}", std::process::id());
    let label = format!("standby.e2e={network}");
    docker::docker(&["network", "create", "--label", &label, &network]).expect("docker network create");
    let _cleanup =
        docker::Cleanup { data: std::env::temp_dir().join("no-such-standby-data"), network: network.clone() };
    let dir = tempfile::tempdir().expect("a temp dir");
    let builder =
        standby_e2e::server_process::ServerBuilder::new(&dir.path().join("data"), &dir.path().join("log"), "open")
            .listen(std::net::SocketAddr::from(([0, 0, 0, 0], 0)))
            .args(&["--provider", "docker", "--image", &docker::image(), "--docker-network", &network]);
    let Err(error) = builder.try_start().await else {
        panic!("the server started on a network where containers reach each other")
    };
    assert!(
        error.contains(&format!("the network `{network}` cannot hold sandboxes"))
            && error.contains("com.docker.network.bridge.enable_icc"),
        "{error}"
    );
}

#[tokio::test]
async fn a_crashed_servers_rules_stay_closed_until_prune_removes_them_with_its_network() {
    if !docker::available("isolation: after a crash") {
        return;
    }
    let mut server = Server::start_on(&docker::image(), &["--pool-size", "0"]).await;
    let network = server.cleanup.network.clone();
    let bridge = bridge(&network).expect("the network's bridge");
    let process = server.process.take().expect("the server runs");
    process.crash().await;
    let ours = || -> Vec<String> {
        firewall_rules("iptables", &bridge).into_iter().filter(|line| line.contains("STANDBY-")).collect()
    };
    assert!(ours().iter().any(|line| line.contains("-j REJECT")), "a crash leaves the rules, closed: {:#?}", ours());

    let pruned = Command::new(standby_e2e::server_process::server_bin())
        .args(["prune", "--instance", &server.cleanup.instance(), "--network", &network])
        .arg("--data-dir")
        .arg(&server.cleanup.data)
        .output()
        .expect("run prune");
    assert!(pruned.status.success(), "{}", String::from_utf8_lossy(&pruned.stderr));
    assert!(docker::docker(&["network", "inspect", &network]).is_none(), "the network is removed");
    assert_eq!(ours(), Vec::<String>::new(), "its rules with it");
}

#[tokio::test]
async fn unfiltered_puts_no_rule_in_place_and_leaves_the_host_to_its_own_firewall() {
    if !docker::available("isolation: unfiltered") {
        return;
    }
    let server = Server::start_on(&docker::image(), &["--pool-size", "1", "--sandbox-egress", "unfiltered"]).await;
    let sandbox = server.ready_standby().await;
    let bridge = bridge(&server.cleanup.network).expect("the network's bridge");
    let ours: Vec<String> =
        firewall_rules("iptables", &bridge).into_iter().filter(|line| line.contains("STANDBY-")).collect();
    assert_eq!(ours, Vec::<String>::new(), "no rule of the server's");
    let host_port = host_listener();
    let reply = probe(&sandbox, &gateway(&server.cleanup.network), host_port, "");
    assert_eq!(reply, Probe::Reached("host-listener\n".to_owned()), "the host's own firewall decides: none here");
    server.stop().await;
}
