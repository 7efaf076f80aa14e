//! The pure half of the spread capacity test: where each standby goes
//! (which replica it dials, which load-generator process holds it) and the
//! line protocol between the bench and its worker processes.
//!
//! The load generator is spread over processes because one process may
//! hold only as many sockets as its open-files limit allows; the standbys
//! are spread over replicas because a replicated deployment is measured
//! with its agents spread the way a balancer would spread them.

/// Standby `index` (in the order the bench connects them) dials replica
/// `index % replicas` and is held by worker `index % workers`: round-robin
/// on both, so every replica and every worker gets within one of an equal
/// share, whatever the total.
pub fn place(index: usize, replicas: usize, workers: usize) -> (usize, usize) {
    (index % replicas.max(1), index % workers.max(1))
}

/// The fewest worker processes that hold `connections` sockets with
/// `per_worker` each (each worker's open-files limit minus its reserve).
pub fn workers_needed(connections: usize, per_worker: usize) -> usize {
    connections.div_ceil(per_worker.max(1)).max(1)
}

/// A line from the bench to a worker (its stdin).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Hold a standby: dial `url` (the replica's `http://` base) with
    /// `credential`.
    Connect { url: String, credential: String },
}

impl Command {
    pub fn encode(&self) -> String {
        match self {
            Self::Connect { url, credential } => format!("connect {url} {credential}"),
        }
    }

    pub fn decode(line: &str) -> Option<Self> {
        let mut words = line.split_whitespace();
        match (words.next()?, words.next(), words.next(), words.next()) {
            ("connect", Some(url), Some(credential), None) => {
                Some(Self::Connect { url: url.to_owned(), credential: credential.to_owned() })
            }
            _ => None,
        }
    }
}

/// A line from a worker to the bench (its stdout).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The worker's standbys now: connected and not assigned, whose upgrade
    /// failed, and which the server closed before an assignment.
    Counts { connected: usize, failed: usize, lost: usize },
    /// A standby read the assignment frame of run `id` at `monotonic_ns`
    /// (`CLOCK_MONOTONIC`, one clock for every process of the machine, so
    /// the bench subtracts the instant it sent `POST /v1/runs`).
    Assigned { id: String, monotonic_ns: u64 },
}

impl Event {
    pub fn encode(&self) -> String {
        match self {
            Self::Counts { connected, failed, lost } => format!("counts {connected} {failed} {lost}"),
            Self::Assigned { id, monotonic_ns } => format!("assigned {id} {monotonic_ns}"),
        }
    }

    pub fn decode(line: &str) -> Option<Self> {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["counts", connected, failed, lost] => Some(Self::Counts {
                connected: connected.parse().ok()?,
                failed: failed.parse().ok()?,
                lost: lost.parse().ok()?,
            }),
            ["assigned", id, ns] => Some(Self::Assigned { id: (*id).to_owned(), monotonic_ns: ns.parse().ok()? }),
            _ => None,
        }
    }
}

/// Runs per second of a burst: `runs` over the span from the first request
/// sent to the last assignment frame read (nanoseconds of one clock);
/// `None` for an empty or zero span.
pub fn runs_per_s(runs: usize, first_sent_ns: u64, last_frame_ns: u64) -> Option<f64> {
    let span = last_frame_ns.checked_sub(first_sent_ns).filter(|span| *span > 0)?;
    Some(runs as f64 / (span as f64 / 1e9))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many of `total` standbys an equal split gives each of `parts`.
    fn shares(total: usize, parts: usize) -> Vec<usize> {
        (0..parts).map(|part| total / parts + usize::from(part < total % parts)).collect()
    }

    #[test]
    fn round_robin_places_within_one_of_an_equal_share() {
        let mut replicas = [0usize; 3];
        let mut workers = [0usize; 4];
        for index in 0..10_001 {
            let (replica, worker) = place(index, 3, 4);
            replicas[replica] += 1;
            workers[worker] += 1;
        }
        assert_eq!(replicas.to_vec(), shares(10_001, 3));
        assert_eq!(workers.to_vec(), shares(10_001, 4));
        assert_eq!(shares(10_001, 3), vec![3334, 3334, 3333]);
        assert_eq!(place(5, 1, 1), (0, 0));
        assert_eq!(place(5, 0, 0), (0, 0), "zero parts are one");
        assert_eq!(place(4, 3, 2), (1, 0));
    }

    #[test]
    fn workers_cover_the_connections_under_their_limit() {
        assert_eq!(workers_needed(50_000, 15_000), 4);
        assert_eq!(workers_needed(10_000, 15_000), 1);
        assert_eq!(workers_needed(0, 15_000), 1);
        assert_eq!(workers_needed(30_000, 15_000), 2);
    }

    #[test]
    fn lines_round_trip_and_garbage_is_refused() {
        let connect = Command::Connect { url: "http://127.0.0.2:41234".into(), credential: "sbc_abc".into() };
        assert_eq!(Command::decode(&connect.encode()), Some(connect));
        for event in [
            Event::Counts { connected: 3, failed: 1, lost: 0 },
            Event::Assigned { id: "run_1".into(), monotonic_ns: 12_345 },
        ] {
            assert_eq!(Event::decode(&event.encode()), Some(event));
        }
        assert_eq!(Command::decode("connect only-url"), None);
        assert_eq!(Event::decode("counts 1 2"), None);
        assert_eq!(Event::decode("assigned run_1 soon"), None);
    }

    #[test]
    fn runs_per_second_over_the_span() {
        assert_eq!(runs_per_s(1000, 1_000_000_000, 3_000_000_000), Some(500.0));
        assert_eq!(runs_per_s(10, 5, 5), None);
        assert_eq!(runs_per_s(10, 6, 5), None);
    }
}
