//! [`FaultProxy`]: a TCP proxy on 127.0.0.1 that stands between agents and
//! a server and breaks their connections on purpose.
//!
//! Every accepted connection is forwarded to the current target (which can
//! change, so a restarted server on a new port keeps the same public URL).
//! Faults, on cue ([`FaultProxy::inject`], [`FaultProxy::cut_all`],
//! [`FaultProxy::set_black_hole`]) or chosen by a [`FaultPolicy`] for each
//! chunk of data that passes:
//!
//! - **delay**: the chunk (and everything behind it in its direction) waits;
//! - **stall**: nothing more is forwarded either way until the stall ends;
//!   what arrives meanwhile is held, so the peers feel backpressure;
//! - **reset**: both sides get an RST (`SO_LINGER` 0), unsent data is lost;
//! - **black hole**: everything is read and thrown away, nothing answers,
//!   then (when it ends) both sides are closed; new connections can be
//!   black-holed too: accepted, never forwarded;
//! - **cut all**: every live connection is reset at once.
//!
//! Random faults come from [`Rng`], a small PRNG seeded explicitly (see
//! [`seed_from_env`]), so a failing run can be replayed with its seed: the
//! same seed makes the same decisions for the same sequence of chunks
//! (timing can still reorder chunks between connections).

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Identifies one accepted connection.
pub type ConnId = u64;

/// Bytes of the client's first data kept per connection: enough for the
/// request line and headers of the first request (a policy reads the path
/// and the kind of credential from them).
const HEAD_LIMIT: usize = 8 * 1024;

/// Bound on connecting to the target: a target that is down (a restarting
/// server) is answered with a reset at once, not a hang.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Which way a chunk travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the connecting client (the agent) to the target (the server).
    ToServer,
    /// From the target back to the client.
    ToClient,
}

/// One fault, applied to one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Hold the chunk this long before forwarding it.
    Delay(Duration),
    /// Forward nothing either way, for this long (`None`: until
    /// [`FaultProxy::resume`]).
    Stall(Option<Duration>),
    /// Reset both sides now.
    Reset,
    /// Swallow everything either way, answer nothing; when it ends (after
    /// the duration, or on [`FaultProxy::resume`]), close both sides.
    BlackHole(Option<Duration>),
}

impl Fault {
    /// The kind's name, for counts and messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Delay(_) => "delay",
            Self::Stall(_) => "stall",
            Self::Reset => "reset",
            Self::BlackHole(_) => "black_hole",
        }
    }
}

/// What a policy knows about a connection.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub id: ConnId,
    /// The client's first bytes (at most 8 KiB): the first request's line
    /// and headers.
    pub head: Vec<u8>,
}

/// Decides, for each chunk that passes, whether to inject a fault. Called
/// on the connection's task with the proxy's policy lock held: it must be
/// quick and must not block.
pub trait FaultPolicy: Send + 'static {
    fn on_data(&mut self, conn: &ConnInfo, direction: Direction, data: &[u8]) -> Option<Fault>;
}

/// SplitMix64: tiny, fast, good enough to pick faults, and reproducible
/// from its seed (no global state, no OS entropy).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// A number in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// A duration in `[low, high]`, to the millisecond.
    pub fn duration(&mut self, low: Duration, high: Duration) -> Duration {
        let (low_ms, high_ms) = (low.as_millis() as u64, high.as_millis().max(low.as_millis()) as u64);
        Duration::from_millis(low_ms + self.below(high_ms - low_ms + 1))
    }

    /// A derived generator: independent streams from one printed seed.
    pub fn fork(&mut self) -> Self {
        Self(self.next_u64())
    }
}

/// The seed in `var` when set (a replay), else a fresh one. Either way it
/// is printed, so any run can be replayed.
pub fn seed_from_env(var: &str) -> u64 {
    let seed = match std::env::var(var) {
        Ok(text) => text.trim().parse().unwrap_or_else(|_| panic!("{var}={text} is not an unsigned integer")),
        Err(_) => RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now())),
    };
    eprintln!("seed {seed} (replay with {var}={seed})");
    seed
}

/// Fault durations a [`RandomFaults`] draws from.
#[derive(Debug, Clone, Copy)]
pub struct FaultRanges {
    pub delay: (Duration, Duration),
    pub stall: (Duration, Duration),
    pub black_hole: (Duration, Duration),
}

impl Default for FaultRanges {
    fn default() -> Self {
        Self {
            delay: (Duration::from_millis(10), Duration::from_millis(300)),
            stall: (Duration::from_millis(100), Duration::from_millis(1500)),
            black_hole: (Duration::from_millis(300), Duration::from_millis(2000)),
        }
    }
}

/// Random faults from a seed: for each chunk, a fault with `probability`,
/// of a kind picked by weight (delay, stall, reset, black hole), with a
/// duration from [`FaultRanges`]. Every fault is timed, so connections
/// always recover or end.
#[derive(Debug, Clone)]
pub struct RandomFaults {
    rng: Rng,
    probability: f64,
    weights: [u64; 4],
    ranges: FaultRanges,
}

impl RandomFaults {
    pub fn new(seed: u64, probability: f64) -> Self {
        Self { rng: Rng::new(seed), probability, weights: [4, 3, 3, 1], ranges: FaultRanges::default() }
    }

    /// Relative weights of delay, stall, reset and black hole.
    pub fn weights(mut self, delay: u64, stall: u64, reset: u64, black_hole: u64) -> Self {
        self.weights = [delay, stall, reset, black_hole];
        self
    }

    pub fn ranges(mut self, ranges: FaultRanges) -> Self {
        self.ranges = ranges;
        self
    }

    /// Draws whether to inject at this chunk, with `probability`.
    pub fn roll(&mut self, probability: f64) -> Option<Fault> {
        self.rng.chance(probability).then(|| self.pick())
    }

    /// Draws one fault (always).
    pub fn pick(&mut self) -> Fault {
        let total: u64 = self.weights.iter().sum();
        let mut draw = self.rng.below(total);
        let mut kind = 0;
        for (index, weight) in self.weights.iter().enumerate() {
            if draw < *weight {
                kind = index;
                break;
            }
            draw -= weight;
        }
        let ranges = self.ranges;
        match kind {
            0 => Fault::Delay(self.rng.duration(ranges.delay.0, ranges.delay.1)),
            1 => Fault::Stall(Some(self.rng.duration(ranges.stall.0, ranges.stall.1))),
            2 => Fault::Reset,
            _ => Fault::BlackHole(Some(self.rng.duration(ranges.black_hole.0, ranges.black_hole.1))),
        }
    }
}

impl FaultPolicy for RandomFaults {
    fn on_data(&mut self, _conn: &ConnInfo, _direction: Direction, _data: &[u8]) -> Option<Fault> {
        let probability = self.probability;
        self.roll(probability)
    }
}

/// Counts of what the proxy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProxyStats {
    pub accepted: u64,
    /// Connections reset because the target could not be reached.
    pub target_unreachable: u64,
    pub delays: u64,
    pub stalls: u64,
    pub resets: u64,
    pub black_holes: u64,
    /// Connections accepted while new connections were black-holed.
    pub black_holed_accepts: u64,
    pub cut_alls: u64,
    /// Connections reset by [`FaultProxy::cut_all`].
    pub cut_connections: u64,
    /// Bytes read but not (yet) forwarded because of a stall.
    pub held_bytes: u64,
    /// Bytes thrown away by black holes.
    pub swallowed_bytes: u64,
    /// Bytes forwarded, both directions.
    pub forwarded_bytes: u64,
}

impl fmt::Display for ProxyStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} connections ({} to an unreachable target), faults: {} delays, {} stalls, {} resets, {} black holes \
             (+{} black-holed accepts), {} cut-alls resetting {} connections",
            self.accepted,
            self.target_unreachable,
            self.delays,
            self.stalls,
            self.resets,
            self.black_holes,
            self.black_holed_accepts,
            self.cut_alls,
            self.cut_connections
        )
    }
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    target_unreachable: AtomicU64,
    delays: AtomicU64,
    stalls: AtomicU64,
    resets: AtomicU64,
    black_holes: AtomicU64,
    black_holed_accepts: AtomicU64,
    cut_alls: AtomicU64,
    cut_connections: AtomicU64,
    held_bytes: AtomicU64,
    swallowed_bytes: AtomicU64,
    forwarded_bytes: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// What a connection's pumps do with the data they read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Forward,
    Stalled,
    BlackHoled,
    /// End with an RST on both sides.
    Reset,
    /// End with a close (FIN) on both sides.
    Close,
}

impl Mode {
    fn ends(self) -> bool {
        matches!(self, Self::Reset | Self::Close)
    }
}

/// A connection's mode, with a generation so a timed fault that ends only
/// undoes itself, never a fault injected after it.
#[derive(Debug, Clone, Copy)]
struct ModeState {
    mode: Mode,
    generation: u64,
}

#[derive(Debug)]
struct Conn {
    mode: watch::Sender<ModeState>,
    head: Mutex<Vec<u8>>,
    /// A delay injected on cue, for the next chunk read either way.
    pending_delay: Mutex<Option<Duration>>,
}

impl Conn {
    fn set(&self, mode: Mode) -> u64 {
        let mut generation = 0;
        self.mode.send_modify(|state| {
            // An ending is final: nothing revives a connection being torn down.
            if !state.mode.ends() {
                state.mode = mode;
            }
            state.generation += 1;
            generation = state.generation;
        });
        generation
    }

    /// Ends a timed fault: `then` replaces `mode` if nothing changed since.
    fn end(&self, generation: u64, mode: Mode, then: Mode) {
        self.mode.send_if_modified(|state| {
            let current = state.generation == generation && state.mode == mode;
            if current {
                state.mode = then;
                state.generation += 1;
            }
            current
        });
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Shared {
    target: Mutex<SocketAddr>,
    conns: Mutex<HashMap<ConnId, Arc<Conn>>>,
    next_id: AtomicU64,
    policy: Mutex<Option<Box<dyn FaultPolicy>>>,
    black_hole: watch::Sender<bool>,
    counters: Counters,
    accepted_at: Mutex<Vec<Instant>>,
    /// Wakes [`FaultProxy::wait_connections`] on every accept and close.
    changed: watch::Sender<()>,
}

impl Shared {
    /// Applies `fault` to `conn`; the delay to apply to the current chunk.
    fn apply(&self, conn: &Arc<Conn>, fault: Fault) -> Option<Duration> {
        let counters = &self.counters;
        match fault {
            Fault::Delay(delay) => {
                bump(&counters.delays, 1);
                return Some(delay);
            }
            Fault::Stall(duration) => {
                bump(&counters.stalls, 1);
                let generation = conn.set(Mode::Stalled);
                if let Some(duration) = duration {
                    end_later(conn, generation, duration, Mode::Stalled, Mode::Forward);
                }
            }
            Fault::Reset => {
                bump(&counters.resets, 1);
                conn.set(Mode::Reset);
            }
            Fault::BlackHole(duration) => {
                bump(&counters.black_holes, 1);
                let generation = conn.set(Mode::BlackHoled);
                if let Some(duration) = duration {
                    end_later(conn, generation, duration, Mode::BlackHoled, Mode::Close);
                }
            }
        }
        None
    }

    fn decide(&self, info: &ConnInfo, direction: Direction, data: &[u8]) -> Option<Fault> {
        lock(&self.policy).as_mut().and_then(|policy| policy.on_data(info, direction, data))
    }
}

fn end_later(conn: &Arc<Conn>, generation: u64, after: Duration, mode: Mode, then: Mode) {
    let conn = Arc::downgrade(conn);
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        if let Some(conn) = conn.upgrade() {
            conn.end(generation, mode, then);
        }
    });
}

/// A running proxy. Dropping it stops accepting and resets every
/// connection.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy").field("addr", &self.addr).field("stats", &self.stats()).finish_non_exhaustive()
    }
}

impl FaultProxy {
    /// Listens on 127.0.0.1:0 and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy on 127.0.0.1:0");
        let addr = listener.local_addr().expect("a bound listener has an address");
        let shared = Arc::new(Shared {
            target: Mutex::new(target),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            policy: Mutex::new(None),
            black_hole: watch::channel(false).0,
            counters: Counters::default(),
            accepted_at: Mutex::new(Vec::new()),
            changed: watch::channel(()).0,
        });
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Self { addr, shared, accept }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>`: the base URL to give agents.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// New connections go to `target` from now on (a restarted server).
    pub fn set_target(&self, target: SocketAddr) {
        *lock(&self.shared.target) = target;
    }

    /// Random or scripted faults from now on.
    pub fn set_policy(&self, policy: impl FaultPolicy) {
        *lock(&self.shared.policy) = Some(Box::new(policy));
    }

    pub fn clear_policy(&self) {
        *lock(&self.shared.policy) = None;
    }

    /// Live connections, oldest first.
    pub fn connections(&self) -> Vec<ConnId> {
        let mut ids: Vec<ConnId> = lock(&self.shared.conns).keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Applies `fault` to a live connection (a delay applies to the next
    /// chunk read either way). False when the connection is gone.
    pub fn inject(&self, conn: ConnId, fault: Fault) -> bool {
        let Some(state) = lock(&self.shared.conns).get(&conn).cloned() else { return false };
        if let Fault::Delay(delay) = fault {
            bump(&self.shared.counters.delays, 1);
            *lock(&state.pending_delay) = Some(delay);
            return true;
        }
        self.shared.apply(&state, fault);
        true
    }

    /// Ends an open-ended stall (forwarding resumes) or black hole (the
    /// connection is closed).
    pub fn resume(&self, conn: ConnId) {
        if let Some(state) = lock(&self.shared.conns).get(&conn).cloned() {
            let mode = state.mode.borrow().mode;
            match mode {
                Mode::Stalled => {
                    state.set(Mode::Forward);
                }
                Mode::BlackHoled => {
                    state.set(Mode::Close);
                }
                Mode::Forward | Mode::Reset | Mode::Close => {}
            }
        }
    }

    /// While on, new connections are accepted and never forwarded (nothing
    /// is answered); turning it off closes them.
    pub fn set_black_hole(&self, on: bool) {
        self.shared.black_hole.send_replace(on);
    }

    /// Resets every live connection at once; how many there were.
    pub fn cut_all(&self) -> usize {
        let conns: Vec<Arc<Conn>> = lock(&self.shared.conns).values().cloned().collect();
        bump(&self.shared.counters.cut_alls, 1);
        bump(&self.shared.counters.cut_connections, conns.len() as u64);
        for conn in &conns {
            conn.set(Mode::Reset);
        }
        conns.len()
    }

    pub fn stats(&self) -> ProxyStats {
        let c = &self.shared.counters;
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        ProxyStats {
            accepted: get(&c.accepted),
            target_unreachable: get(&c.target_unreachable),
            delays: get(&c.delays),
            stalls: get(&c.stalls),
            resets: get(&c.resets),
            black_holes: get(&c.black_holes),
            black_holed_accepts: get(&c.black_holed_accepts),
            cut_alls: get(&c.cut_alls),
            cut_connections: get(&c.cut_connections),
            held_bytes: get(&c.held_bytes),
            swallowed_bytes: get(&c.swallowed_bytes),
            forwarded_bytes: get(&c.forwarded_bytes),
        }
    }

    /// When each connection at or after `since` was accepted.
    pub fn accepted_since(&self, since: Instant) -> Vec<Instant> {
        lock(&self.shared.accepted_at).iter().copied().filter(|at| *at >= since).collect()
    }

    /// Waits until `check` holds for the number of live connections (an
    /// event: woken on every accept and close), up to `timeout`.
    pub async fn wait_connections(&self, what: &str, timeout: Duration, check: impl Fn(usize) -> bool) {
        let mut changed = self.shared.changed.subscribe();
        let wait = async {
            loop {
                if check(lock(&self.shared.conns).len()) {
                    return;
                }
                if changed.changed().await.is_err() {
                    return;
                }
            }
        };
        let live = || lock(&self.shared.conns).len();
        tokio::time::timeout(timeout, wait)
            .await
            .unwrap_or_else(|_| panic!("proxy: timed out waiting for {what}: {} live connections", live()));
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for conn in lock(&self.shared.conns).values() {
            conn.set(Mode::Reset);
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Out of descriptors, most likely: give connections time to close.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = client.set_nodelay(true);
        bump(&shared.counters.accepted, 1);
        lock(&shared.accepted_at).push(Instant::now());
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            mode: watch::channel(ModeState { mode: Mode::Forward, generation: 0 }).0,
            head: Mutex::new(Vec::new()),
            pending_delay: Mutex::new(None),
        });
        lock(&shared.conns).insert(id, Arc::clone(&conn));
        shared.changed.send_replace(());
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            if *shared.black_hole.borrow() {
                bump(&shared.counters.black_holed_accepts, 1);
                conn.set(Mode::BlackHoled);
                black_hole_accepted(client, &conn, &shared).await;
            } else {
                serve(id, client, &conn, &shared).await;
            }
            lock(&shared.conns).remove(&id);
            shared.changed.send_replace(());
        });
    }
}

/// A connection accepted while new connections are black-holed: read and
/// thrown away until the black hole is lifted (closed then), or the
/// connection is reset.
async fn black_hole_accepted(mut client: TcpStream, conn: &Conn, shared: &Shared) {
    let mut lifted = shared.black_hole.subscribe();
    let mut mode = conn.mode.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    let reset = loop {
        tokio::select! {
            read = client.read(&mut buf) => match read {
                Ok(0) | Err(_) => break false,
                Ok(n) => bump(&shared.counters.swallowed_bytes, n as u64),
            },
            () = lifted_off(&mut lifted) => break false,
            ending = ended(&mut mode) => break ending == Mode::Reset,
        }
    };
    if reset {
        let _ = client.set_zero_linger();
    }
}

async fn serve(id: ConnId, mut client: TcpStream, conn: &Arc<Conn>, shared: &Arc<Shared>) {
    let target = *lock(&shared.target);
    let mut upstream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target)).await {
        Ok(Ok(upstream)) => upstream,
        _ => {
            bump(&shared.counters.target_unreachable, 1);
            let _ = client.set_zero_linger();
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    let reset = {
        let (client_read, client_write) = client.split();
        let (upstream_read, upstream_write) = upstream.split();
        let to_server = pump(id, client_read, upstream_write, Direction::ToServer, conn, shared);
        let to_client = pump(id, upstream_read, client_write, Direction::ToClient, conn, shared);
        let (a, b) = tokio::join!(to_server, to_client);
        a == Mode::Reset || b == Mode::Reset || conn.mode.borrow().mode == Mode::Reset
    };
    if reset {
        let _ = client.set_zero_linger();
        let _ = upstream.set_zero_linger();
    }
}

/// Resolves once the connection is ending: how (a dropped sender ends it
/// with a close). The `watch` guard never leaves this function, so the
/// futures that await it stay `Send`.
async fn ended(mode: &mut watch::Receiver<ModeState>) -> Mode {
    mode.wait_for(|state| state.mode.ends()).await.map_or(Mode::Close, |state| state.mode)
}

/// Resolves once the connection is not stalled: its mode then.
async fn settled(mode: &mut watch::Receiver<ModeState>) -> Mode {
    mode.wait_for(|state| state.mode != Mode::Stalled).await.map_or(Mode::Close, |state| state.mode)
}

/// Resolves once new connections are no longer black-holed.
async fn lifted_off(black_hole: &mut watch::Receiver<bool>) {
    let _ = black_hole.wait_for(|on| !*on).await.map(|_| ());
}

/// Moves data one way until EOF or the connection ends; the mode it ended
/// in (`Forward` for a plain EOF).
async fn pump(
    id: ConnId,
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    direction: Direction,
    conn: &Arc<Conn>,
    shared: &Arc<Shared>,
) -> Mode {
    let mut mode = conn.mode.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return Mode::Forward;
                }
                Ok(n) => n,
            },
            ending = ended(&mut mode) => return ending,
        };
        let data = &buf[..n];
        let info = {
            let mut head = lock(&conn.head);
            if direction == Direction::ToServer && head.len() < HEAD_LIMIT {
                let room = HEAD_LIMIT - head.len();
                head.extend_from_slice(&data[..n.min(room)]);
            }
            ConnInfo { id, head: head.clone() }
        };
        let cued = lock(&conn.pending_delay).take();
        let delay = shared.decide(&info, direction, data).and_then(|fault| shared.apply(conn, fault)).or(cued);
        // Held while stalled; thrown away while black-holed.
        let current = {
            let state = mode.borrow_and_update().mode;
            if state == Mode::Stalled {
                bump(&shared.counters.held_bytes, n as u64);
            }
            settled(&mut mode).await
        };
        match current {
            Mode::Reset | Mode::Close => return current,
            Mode::BlackHoled => {
                bump(&shared.counters.swallowed_bytes, n as u64);
                continue;
            }
            Mode::Forward | Mode::Stalled => {}
        }
        if let Some(delay) = delay {
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                ending = ended(&mut mode) => return ending,
            }
        }
        tokio::select! {
            written = to.write_all(data) => {
                if written.is_err() {
                    return Mode::Forward;
                }
                bump(&shared.counters.forwarded_bytes, n as u64);
            }
            ending = ended(&mut mode) => return ending,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use super::*;

    /// An echo server that counts what it received and the connections it
    /// accepted.
    struct Echo {
        addr: SocketAddr,
        received: Arc<AtomicU64>,
        accepted: Arc<AtomicU64>,
        task: JoinHandle<()>,
    }

    impl Echo {
        async fn start() -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("an address");
            let received = Arc::new(AtomicU64::new(0));
            let accepted = Arc::new(AtomicU64::new(0));
            let (r, a) = (Arc::clone(&received), Arc::clone(&accepted));
            let task = tokio::spawn(async move {
                while let Ok((mut socket, _)) = listener.accept().await {
                    a.fetch_add(1, Ordering::SeqCst);
                    let r = Arc::clone(&r);
                    tokio::spawn(async move {
                        let mut buf = [0u8; 4096];
                        while let Ok(n) = socket.read(&mut buf).await {
                            if n == 0 || socket.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                            r.fetch_add(n as u64, Ordering::SeqCst);
                        }
                    });
                }
            });
            Self { addr, received, accepted, task }
        }
    }

    impl Drop for Echo {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    const WAIT: Duration = Duration::from_secs(10);

    async fn connect(proxy: &FaultProxy) -> (TcpStream, ConnId) {
        let before = proxy.connections();
        let stream = TcpStream::connect(proxy.addr()).await.expect("connect to the proxy");
        proxy.wait_connections("the new connection", WAIT, |n| n > before.len()).await;
        let id = proxy.connections().into_iter().find(|id| !before.contains(id)).expect("a new connection id");
        (stream, id)
    }

    async fn echo_round(stream: &mut TcpStream, text: &[u8]) -> Vec<u8> {
        stream.write_all(text).await.expect("write");
        let mut back = vec![0u8; text.len()];
        tokio::time::timeout(WAIT, stream.read_exact(&mut back)).await.expect("the echo comes back").expect("read");
        back
    }

    async fn until(what: &str, check: impl Fn() -> bool) {
        let deadline = Instant::now() + WAIT;
        while !check() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Reads until the peer ends the connection: whether with a reset.
    async fn ended_by_reset(stream: &mut TcpStream) -> bool {
        let mut buf = [0u8; 1024];
        loop {
            match tokio::time::timeout(WAIT, stream.read(&mut buf)).await.expect("the connection ends") {
                Ok(0) => return false,
                Ok(_) => {}
                Err(error) => return error.kind() == ErrorKind::ConnectionReset,
            }
        }
    }

    #[tokio::test]
    async fn forwards_both_ways() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await;
        let (mut stream, _) = connect(&proxy).await;
        assert_eq!(echo_round(&mut stream, b"hello").await, b"hello");
        assert_eq!(proxy.stats().forwarded_bytes, 10);
    }

    #[tokio::test]
    async fn a_delay_holds_the_next_chunk_at_least_that_long() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await;
        let (mut stream, id) = connect(&proxy).await;
        let delay = Duration::from_millis(300);
        assert!(proxy.inject(id, Fault::Delay(delay)));
        let sent = Instant::now();
        assert_eq!(echo_round(&mut stream, b"late").await, b"late");
        assert!(sent.elapsed() >= delay, "the delayed chunk came back early");
        assert_eq!(proxy.stats().delays, 1);
    }

    #[tokio::test]
    async fn a_policy_delay_applies_to_the_chunk_it_saw() {
        struct DelayFirst(bool);
        impl FaultPolicy for DelayFirst {
            fn on_data(&mut self, _: &ConnInfo, direction: Direction, _: &[u8]) -> Option<Fault> {
                let first = direction == Direction::ToServer && !self.0;
                self.0 |= first;
                first.then_some(Fault::Delay(Duration::from_millis(200)))
            }
        }
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await;
        proxy.set_policy(DelayFirst(false));
        let (mut stream, _) = connect(&proxy).await;
        let sent = Instant::now();
        assert_eq!(echo_round(&mut stream, b"first").await, b"first");
        assert!(sent.elapsed() >= Duration::from_millis(200));
        assert_eq!(echo_round(&mut stream, b"second").await, b"second");
        assert_eq!(proxy.stats().delays, 1);
    }

    #[tokio::test]
    async fn a_stall_holds_data_until_it_ends_and_loses_nothing() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await;
        let (mut stream, id) = connect(&proxy).await;
        assert_eq!(echo_round(&mut stream, b"before").await, b"before");
        assert!(proxy.inject(id, Fault::Stall(None)));
        stream.write_all(b"held").await.expect("write");
        until("the proxy to hold the chunk", || proxy.stats().held_bytes == 4).await;
        assert_eq!(echo.received.load(Ordering::SeqCst), 6, "nothing passed the stall");
        proxy.resume(id);
        let mut back = [0u8; 4];
        tokio::time::timeout(WAIT, stream.read_exact(&mut back)).await.expect("released").expect("read");
        assert_eq!(&back, b"held");
        assert_eq!(echo_round(&mut stream, b"after").await, b"after");
    }

    #[tokio::test]
    async fn a_timed_stall_ends_by_itself() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await;
        let (mut stream, id) = connect(&proxy).await;
        assert!(proxy.inject(id, Fault::Stall(Some(Duration::from_millis(200)))));
        assert_eq!(echo_round(&mut stream, b"eventually").await, b"eventually");
        assert_eq!(proxy.stats().stalls, 1);
    }

    #[tokio::test]
    async fn a_reset_sends_rst_to_both_sides() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let proxy = FaultProxy::start(listener.local_addr().expect("an address")).await;
        let (mut client, id) = connect(&proxy).await;
        let (mut server, _) = tokio::time::timeout(WAIT, listener.accept()).await.expect("forwarded").expect("accept");
        client.write_all(b"x").await.expect("write");
        let mut one = [0u8; 1];
        server.read_exact(&mut one).await.expect("the byte arrives");
        assert!(proxy.inject(id, Fault::Reset));
        assert!(ended_by_reset(&mut client).await, "the client saw a reset");
        assert!(ended_by_reset(&mut server).await, "the server saw a reset");
        proxy.wait_connections("the connection to go", WAIT, |n| n == 0).await;
        assert_eq!(proxy.stats().resets, 1);
    }

    #[tokio::test]
    async fn a_black_holed_connection_swallows_everything_then_closes() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await;
        let (mut stream, id) = connect(&proxy).await;
        assert!(proxy.inject(id, Fault::BlackHole(None)));
        stream.write_all(b"into the void").await.expect("write");
        until("the proxy to swallow the chunk", || proxy.stats().swallowed_bytes == 13).await;
        assert_eq!(echo.received.load(Ordering::SeqCst), 0, "nothing reached the target");
        proxy.resume(id);
        assert!(!ended_by_reset(&mut stream).await, "closed, not reset");
    }

    #[tokio::test]
    async fn black_holed_accepts_are_never_forwarded() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await;
        proxy.set_black_hole(true);
        let (mut stream, _) = connect(&proxy).await;
        stream.write_all(b"hello?").await.expect("write");
        until("the proxy to swallow the chunk", || proxy.stats().swallowed_bytes == 6).await;
        assert_eq!(echo.accepted.load(Ordering::SeqCst), 0, "the target never saw a connection");
        proxy.set_black_hole(false);
        assert!(!ended_by_reset(&mut stream).await, "closed when the black hole is lifted");
        let (mut stream, _) = connect(&proxy).await;
        assert_eq!(echo_round(&mut stream, b"back").await, b"back");
        assert_eq!(proxy.stats().black_holed_accepts, 1);
    }

    #[tokio::test]
    async fn cut_all_resets_every_connection_and_new_ones_still_work() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await;
        let mut streams = Vec::new();
        for _ in 0..3 {
            let (mut stream, _) = connect(&proxy).await;
            assert_eq!(echo_round(&mut stream, b"up").await, b"up");
            streams.push(stream);
        }
        assert_eq!(proxy.cut_all(), 3);
        for stream in &mut streams {
            assert!(ended_by_reset(stream).await, "every client saw a reset");
        }
        proxy.wait_connections("every connection to go", WAIT, |n| n == 0).await;
        let (mut stream, _) = connect(&proxy).await;
        assert_eq!(echo_round(&mut stream, b"again").await, b"again");
        let stats = proxy.stats();
        assert_eq!((stats.cut_alls, stats.cut_connections), (1, 3));
    }

    #[tokio::test]
    async fn an_unreachable_target_resets_the_client() {
        let gone = TcpListener::bind("127.0.0.1:0").await.expect("bind").local_addr().expect("an address");
        let proxy = FaultProxy::start(gone).await;
        let mut stream = TcpStream::connect(proxy.addr()).await.expect("accepted by the proxy");
        assert!(ended_by_reset(&mut stream).await);
        assert_eq!(proxy.stats().target_unreachable, 1);
        let echo = Echo::start().await;
        proxy.set_target(echo.addr);
        let (mut stream, _) = connect(&proxy).await;
        assert_eq!(echo_round(&mut stream, b"retargeted").await, b"retargeted");
    }

    #[test]
    fn random_faults_replay_from_their_seed() {
        let info = ConnInfo { id: 1, head: Vec::new() };
        let decisions = |seed| {
            let mut policy = RandomFaults::new(seed, 0.3);
            (0..500).map(|_| policy.on_data(&info, Direction::ToServer, b"x")).collect::<Vec<_>>()
        };
        assert_eq!(decisions(42), decisions(42), "the same seed makes the same decisions");
        assert_ne!(decisions(42), decisions(43));
        let faults: Vec<Fault> = decisions(42).into_iter().flatten().collect();
        assert!((100..200).contains(&faults.len()), "about 30% of 500: {}", faults.len());
        for kind in ["delay", "stall", "reset", "black_hole"] {
            assert!(faults.iter().any(|fault| fault.kind() == kind), "no {kind} in {faults:?}");
        }
        let ranges = FaultRanges::default();
        for fault in faults {
            match fault {
                Fault::Delay(d) => assert!(d >= ranges.delay.0 && d <= ranges.delay.1),
                Fault::Stall(d) => assert!(d.is_some_and(|d| d >= ranges.stall.0 && d <= ranges.stall.1)),
                Fault::BlackHole(d) => {
                    assert!(d.is_some_and(|d| d >= ranges.black_hole.0 && d <= ranges.black_hole.1))
                }
                Fault::Reset => {}
            }
        }
    }

    #[tokio::test]
    async fn random_faults_on_live_traffic_never_lose_or_reorder_what_gets_through() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await;
        let short = FaultRanges {
            delay: (Duration::from_millis(1), Duration::from_millis(20)),
            stall: (Duration::from_millis(1), Duration::from_millis(20)),
            black_hole: (Duration::from_millis(1), Duration::from_millis(20)),
        };
        // Delays and stalls only: the stream must come back whole and in order.
        proxy.set_policy(RandomFaults::new(7, 0.5).weights(1, 1, 0, 0).ranges(short));
        let (mut stream, _) = connect(&proxy).await;
        for i in 0..50u32 {
            let text = format!("message {i};");
            assert_eq!(echo_round(&mut stream, text.as_bytes()).await, text.as_bytes());
        }
        let stats = proxy.stats();
        assert!(stats.delays + stats.stalls > 0, "{stats}");
    }
}
