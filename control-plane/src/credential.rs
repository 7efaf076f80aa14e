//! Credentials: minted here, stored only as SHA-256 hashes, checked in
//! constant time.
//!
//! A token reads `<kind>_<id>_<secret>`. The `id` is public and finds the
//! record; the whole token is hashed and the hash compared with
//! [`subtle::ConstantTimeEq`], so neither the lookup nor the comparison
//! leaks how much of a guessed secret was right. The kind prefix lets the
//! server tell an unknown standby credential (`410`, the sandbox is gone)
//! from anything else it does not know (`401`).

use std::fmt;

use rand::Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use standby_protocol::Secret;
use subtle::ConstantTimeEq;

/// Which of the contract's two credentials a token is: the contract's own
/// type, so the machine, the store and the agent never disagree on it.
pub use standby_protocol::CredentialKind;

/// The first part of a token of `kind`, which tells the kinds apart before
/// any lookup.
fn kind_prefix(kind: CredentialKind) -> &'static str {
    match kind {
        CredentialKind::Standby => "sby",
        CredentialKind::Run => "run",
    }
}

/// SHA-256 of a whole token, lowercase hex: the only form a store keeps.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TokenHash(String);

impl TokenHash {
    pub fn of(token: &str) -> Self {
        Self(hex(&Sha256::digest(token.as_bytes())))
    }

    /// Whether `token` hashes to this value, in time independent of where
    /// the two hashes differ.
    pub fn matches(&self, token: &str) -> bool {
        let presented = Self::of(token);
        self.0.as_bytes().ct_eq(presented.0.as_bytes()).into()
    }
}

impl fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A hash is not a secret, but nothing gains from printing it.
        f.write_str("TokenHash(..)")
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The public parts of a presented token, when it has the minted shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed<'a> {
    pub kind: CredentialKind,
    pub id: &'a str,
}

/// Splits a presented token into kind and id; `None` for anything this
/// server never minted.
pub fn parse(token: &str) -> Option<Parsed<'_>> {
    let (prefix, rest) = token.split_once('_')?;
    let kind = [CredentialKind::Standby, CredentialKind::Run].into_iter().find(|kind| kind_prefix(*kind) == prefix)?;
    let (id, secret) = rest.split_once('_')?;
    let plain = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric());
    (plain(id) && plain(secret)).then_some(Parsed { kind, id })
}

/// Source of identifiers and credentials. The dispatch state machine takes
/// one instead of reading a random number generator, so its tests are
/// deterministic.
pub trait Mint: Send {
    /// A fresh identifier starting with `prefix` (`exe`, `sbx`, ...).
    fn id(&mut self, prefix: &str) -> String;
    /// A fresh credential of `kind`: its id and the token to hand out.
    fn credential(&mut self, kind: CredentialKind) -> (String, Secret);
}

/// The production [`Mint`]: ids and secrets from the thread-local CSPRNG.
#[derive(Debug, Default)]
pub struct RandomMint;

fn random_alnum(len: usize) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut rng = rand::rng();
    (0..len).map(|_| char::from(ALPHABET[rng.random_range(0..ALPHABET.len())])).collect()
}

impl Mint for RandomMint {
    fn id(&mut self, prefix: &str) -> String {
        format!("{prefix}_{}", random_alnum(12).to_ascii_lowercase())
    }

    fn credential(&mut self, kind: CredentialKind) -> (String, Secret) {
        let id = random_alnum(16);
        // 43 characters of a 62-letter alphabet: more than 256 bits.
        let token = format!("{}_{id}_{}", kind_prefix(kind), random_alnum(43));
        (id, Secret::new(token))
    }
}

/// A deterministic [`Mint`] for tests: `exe_1`, `sbx_2`, `run_c3_s3`...
#[cfg(test)]
#[derive(Debug, Default)]
pub struct CountingMint {
    next: u64,
}

#[cfg(test)]
impl CountingMint {
    /// Counting from `next`, so that a second machine (a restart in a
    /// test) does not mint the ids of the first.
    pub fn starting_at(next: u64) -> Self {
        Self { next }
    }
}

#[cfg(test)]
impl Mint for CountingMint {
    fn id(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}_{}", self.next)
    }

    fn credential(&mut self, kind: CredentialKind) -> (String, Secret) {
        self.next += 1;
        let id = format!("c{}", self.next);
        let token = format!("{}_{id}_s{}", kind_prefix(kind), self.next);
        (id, Secret::new(token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_tokens_parse_back() {
        let mut mint = RandomMint;
        for kind in [CredentialKind::Standby, CredentialKind::Run] {
            let (id, token) = mint.credential(kind);
            let parsed = parse(token.expose()).expect("a minted token parses");
            assert_eq!(parsed, Parsed { kind, id: &id });
        }
    }

    #[test]
    fn foreign_tokens_do_not_parse() {
        for token in ["", "abc", "sby_", "sby_id", "sby__s", "xyz_id_s", "sby_i-d_s", "run_id_s p"] {
            assert_eq!(parse(token), None, "{token}");
        }
    }

    #[test]
    fn hash_matches_only_its_token() {
        let hash = TokenHash::of("sby_a_secret");
        assert!(hash.matches("sby_a_secret"));
        assert!(!hash.matches("sby_a_secreT"));
        assert!(!format!("{hash:?}").contains(&hash.0));
    }
}
