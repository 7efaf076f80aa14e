//! The cluster secret: what the replicas of one deployment share, so that
//! they recognise each other over plain HTTP without trusting the lease
//! row. The database role of the server can rewrite `holder_url`; knowing
//! the database is therefore no proof of being a replica.
//!
//! Two proofs are made of it, each an HMAC-SHA256 under the secret with a
//! label of its own (so one is never taken for the other):
//!
//! - the **leader's proof** answers a follower's fresh nonce and binds the
//!   leader's id, epoch and the URL it advertises itself. A follower
//!   checks it before it sends the leader anything (`forward.rs`): a
//!   rewritten `holder_url` points at a process that cannot make it, and a
//!   proxy that passes the challenge on to the real leader gets back a
//!   proof of the real leader's URL, not of its own.
//! - the **follower's token** goes with every forwarded call and relayed
//!   socket, and binds the follower's id, the leader's id and epoch: the
//!   leader takes a call as forwarded (answered `503` rather than
//!   forwarded again when it does not lead) only with it.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Fewer bytes than this are too easy to guess.
pub const MIN_LEN: usize = 32;

const LEADER_LABEL: &[u8] = b"standby cluster leader proof v1";
const FOLLOWER_LABEL: &[u8] = b"standby cluster follower token v1";

/// Why the cluster secret file is refused.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("cannot read the cluster secret file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the cluster secret file {path} is readable by other users (mode {mode:o}): chmod 600 it, it lets a \
         process pass for a replica"
    )]
    Exposed { path: PathBuf, mode: u32 },
    #[error(
        "the cluster secret file {path} holds {len} bytes: at least {MIN_LEN} are needed (e.g. `openssl rand -hex \
         32`)"
    )]
    TooShort { path: PathBuf, len: usize },
}

/// The shared secret. `Debug` never shows it.
#[derive(Clone)]
pub struct ClusterSecret(Vec<u8>);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret([REDACTED])")
    }
}

impl ClusterSecret {
    /// The secret in `path` (surrounding whitespace ignored), refused when
    /// group or others may read the file or it is short.
    pub fn load(path: &Path) -> Result<Self, SecretFileError> {
        let read = |source| SecretFileError::Read { path: path.to_owned(), source };
        let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(SecretFileError::Exposed { path: path.to_owned(), mode });
        }
        let bytes = std::fs::read(path).map_err(read)?;
        let secret = bytes.trim_ascii().to_vec();
        if secret.len() < MIN_LEN {
            return Err(SecretFileError::TooShort { path: path.to_owned(), len: secret.len() });
        }
        Ok(Self(secret))
    }

    /// A secret from bytes already in memory (tests, embedders).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self(bytes.to_vec())
    }

    fn mac(&self, label: &[u8], fields: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(label);
        for field in fields {
            // Length-prefixed: no two field lists give the same input.
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        mac
    }

    /// The leader's answer to `nonce`: it is `leader` at `epoch`, reachable
    /// at `url`.
    pub fn leader_proof(&self, nonce: &str, leader: &str, epoch: u64, url: &str) -> String {
        let mac = self.mac(LEADER_LABEL, &[nonce.as_bytes(), leader.as_bytes(), &epoch.to_be_bytes(), url.as_bytes()]);
        crate::credential::hex(&mac.finalize().into_bytes())
    }

    /// Whether `proof` is [`Self::leader_proof`] of these (constant time).
    pub fn verify_leader(&self, proof: &str, nonce: &str, leader: &str, epoch: u64, url: &str) -> bool {
        let Some(proof) = unhex(proof) else { return false };
        let mac = self.mac(LEADER_LABEL, &[nonce.as_bytes(), leader.as_bytes(), &epoch.to_be_bytes(), url.as_bytes()]);
        mac.verify_slice(&proof).is_ok()
    }

    /// The header value a follower's call to `leader` at `epoch` carries:
    /// `<follower> <epoch> <mac>`.
    pub fn follower_token(&self, follower: &str, leader: &str, epoch: u64) -> String {
        let mac = self.mac(FOLLOWER_LABEL, &[follower.as_bytes(), leader.as_bytes(), &epoch.to_be_bytes()]);
        format!("{follower} {epoch} {}", crate::credential::hex(&mac.finalize().into_bytes()))
    }

    /// The follower a token for `me` was made by and the epoch it was made
    /// at, when it is one (constant time in the MAC).
    pub fn verify_follower<'t>(&self, token: &'t str, me: &str) -> Option<(&'t str, u64)> {
        let mut parts = token.rsplitn(3, ' ');
        let (mac, epoch, follower) = (parts.next()?, parts.next()?, parts.next()?);
        let epoch: u64 = epoch.parse().ok()?;
        let mac = unhex(mac)?;
        self.mac(FOLLOWER_LABEL, &[follower.as_bytes(), me.as_bytes(), &epoch.to_be_bytes()])
            .verify_slice(&mac)
            .is_ok()
            .then_some((follower, epoch))
    }
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> ClusterSecret {
        ClusterSecret::from_bytes(b"0123456789abcdef0123456789abcdef")
    }

    #[test]
    fn a_leader_proof_holds_only_for_the_nonce_id_epoch_and_url_it_was_made_for() {
        let proof = secret().leader_proof("n1", "r0", 4, "http://10.0.0.1:8080");
        assert!(secret().verify_leader(&proof, "n1", "r0", 4, "http://10.0.0.1:8080"));
        assert!(!secret().verify_leader(&proof, "n2", "r0", 4, "http://10.0.0.1:8080"), "another nonce");
        assert!(!secret().verify_leader(&proof, "n1", "r1", 4, "http://10.0.0.1:8080"), "another leader");
        assert!(!secret().verify_leader(&proof, "n1", "r0", 5, "http://10.0.0.1:8080"), "another epoch");
        assert!(!secret().verify_leader(&proof, "n1", "r0", 4, "http://proxy:9"), "another URL");
        let other = ClusterSecret::from_bytes(b"another secret, 32 bytes or more!!");
        assert!(!other.verify_leader(&proof, "n1", "r0", 4, "http://10.0.0.1:8080"), "another secret");
        assert!(!secret().verify_leader("zz", "n1", "r0", 4, "http://10.0.0.1:8080"));
    }

    #[test]
    fn a_follower_token_names_its_epoch_and_holds_only_for_its_leader() {
        let token = secret().follower_token("r 1", "r0", 7);
        assert_eq!(secret().verify_follower(&token, "r0"), Some(("r 1", 7)), "an id may hold spaces");
        assert_eq!(secret().verify_follower(&token, "r2"), None, "made for another leader");
        assert_eq!(secret().verify_follower(&token.replace(" 7 ", " 8 "), "r0"), None, "the epoch is bound");
        assert_eq!(secret().verify_follower("r1 7", "r0"), None);
    }

    #[test]
    fn the_secret_never_prints() {
        assert!(!format!("{:?}", secret()).contains("0123"));
    }

    #[test]
    fn a_file_others_may_read_or_a_short_one_is_refused() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("cluster.secret");
        std::fs::write(&path, "0123456789abcdef0123456789abcdef\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(matches!(ClusterSecret::load(&path), Err(SecretFileError::Exposed { mode: 0o644, .. })));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert!(ClusterSecret::load(&path).is_ok());
        std::fs::write(&path, "short").expect("write");
        assert!(matches!(ClusterSecret::load(&path), Err(SecretFileError::TooShort { len: 5, .. })));
        assert!(matches!(ClusterSecret::load(&dir.path().join("none")), Err(SecretFileError::Read { .. })));
    }
}
