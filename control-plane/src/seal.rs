//! Sealing at rest: what a run was submitted with (secrets, cloud env, git
//! passwords, attachment contents, metadata) is kept in the store only
//! encrypted, with XChaCha20-Poly1305 under the server's secret key.
//!
//! Every record gets a fresh random 192-bit nonce (large enough to draw at
//! random without counting) and is bound to its record id as associated
//! data, so a sealed blob copied to another run's row does not open.
//!
//! The key lives in a file of its own (`--secret-key-file`), 64 hex
//! digits. A single server on SQLite generates it, mode 0600, when absent;
//! replicas on PostgreSQL must share one, so theirs is made beforehand
//! (`standby-server keygen`) and never generated at start, and the store
//! keeps a check of it ([`Sealer::key_check`]) that refuses another key.

use std::fmt;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use rand::RngCore as _;
use sha2::Sha256;

const KEY_LEN: usize = 32;
const NONCE_LEN: usize = 24;
/// Marks a sealed record (and its format version) in the store.
const PREFIX: &str = "sealed1:";

/// A problem with the secret key file, naming it.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("the secret key file {path} cannot be read: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the secret key file {path} is not a key: it must hold exactly 64 hexadecimal digits (32 bytes), such as `openssl rand -hex 32` writes"
    )]
    Malformed { path: PathBuf },
    #[error(
        "the secret key file {path} does not exist: replicas on a PostgreSQL store must all seal with one key, so \
         none is generated at start: make it once with `standby-server keygen {path}` and give every replica a copy \
         (--secret-key-file)"
    )]
    Missing { path: PathBuf },
    #[error("the secret key file {path} cannot be created: {source}")]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A sealed record that does not open: another key, another record, or
/// damaged bytes. Never says more (nothing of the content is known).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the sealed record `{record_id}` does not open with this server's secret key (another key, another record, or damaged)"
)]
pub struct OpenError {
    pub record_id: String,
}

/// The 256-bit key records are sealed with. Debug prints `[REDACTED]`.
#[derive(Clone)]
pub struct SealKey([u8; KEY_LEN]);

impl fmt::Debug for SealKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SealKey([REDACTED])")
    }
}

impl SealKey {
    /// A fresh key from the operating system's CSPRNG (through `rand`).
    pub fn random() -> Self {
        let mut key = [0; KEY_LEN];
        rand::rng().fill_bytes(&mut key);
        Self(key)
    }

    /// Parses a key file's text: 64 hex digits, surrounding whitespace
    /// ignored.
    fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        if text.len() != KEY_LEN * 2 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut key = [0; KEY_LEN];
        for (i, byte) in key.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[i * 2..i * 2 + 2], 16).ok()?;
        }
        Some(Self(key))
    }

    /// Reads the key at `path`; [`KeyFileError::Missing`] when there is no
    /// file there.
    pub fn load(path: &Path) -> Result<Self, KeyFileError> {
        match std::fs::read(path) {
            Ok(bytes) => {
                let key = std::str::from_utf8(&bytes)
                    .ok()
                    .and_then(Self::parse)
                    .ok_or_else(|| KeyFileError::Malformed { path: path.to_owned() })?;
                if let Ok(meta) = std::fs::metadata(path)
                    && meta.permissions().mode() & 0o077 != 0
                {
                    tracing::warn!(
                        path = %path.display(),
                        mode = format!("{:o}", meta.permissions().mode() & 0o777),
                        "the secret key file is readable by other users: chmod 600 it"
                    );
                }
                Ok(key)
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                Err(KeyFileError::Missing { path: path.to_owned() })
            }
            Err(source) => Err(KeyFileError::Read { path: path.to_owned(), source }),
        }
    }

    /// Reads the key at `path`; when there is no file there, generates one
    /// (mode 0600, never overwriting a file that appeared meanwhile).
    /// `true` with the key when it was generated.
    pub fn load_or_generate(path: &Path) -> Result<(Self, bool), KeyFileError> {
        match Self::load(path) {
            Ok(key) => Ok((key, false)),
            Err(KeyFileError::Missing { .. }) => Self::generate(path).map(|key| (key, true)),
            Err(error) => Err(error),
        }
    }

    /// A fresh key written to `path` (mode 0600, its directory made 0700
    /// when missing); an existing file is never overwritten.
    pub fn generate(path: &Path) -> Result<Self, KeyFileError> {
        let key = Self::random();
        key.write_new(path).map_err(|source| KeyFileError::Create { path: path.to_owned(), source })?;
        Ok(key)
    }

    fn write_new(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        }
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
        let hex = crate::credential::hex(&self.0);
        file.write_all(format!("{hex}\n").as_bytes())?;
        file.sync_all()
    }
}

/// Seals and opens records with one key, and digests what must be
/// compared but not kept. Debug prints `[REDACTED]`.
pub struct Sealer {
    cipher: XChaCha20Poly1305,
    /// HMAC-SHA256 key of [`Sealer::digest`], derived from the seal key so
    /// that one key serves two purposes without being used for both.
    digest_key: [u8; 32],
    /// [`Sealer::key_check`], derived under a label of its own.
    key_check: [u8; 32],
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Sealer([REDACTED])")
    }
}

impl Sealer {
    pub fn new(key: &SealKey) -> Self {
        let digest_key = mac(&key.0, &[DIGEST_KEY_LABEL]);
        let key_check = mac(&key.0, &[KEY_CHECK_LABEL]);
        Self { cipher: XChaCha20Poly1305::new(&key.0.into()), digest_key, key_check }
    }

    /// What a store keeps to recognise the key its records are sealed
    /// with (hex HMAC-SHA256 of a constant): equal for one key, different
    /// for another, and no help in finding the key.
    pub fn key_check(&self) -> String {
        crate::credential::hex(&self.key_check)
    }

    /// A keyed digest of `bytes` (hex HMAC-SHA256): equal for equal bytes
    /// under one key, and, unlike a plain hash, no help to whoever reads
    /// the database and guesses what the bytes held (a request's secrets).
    pub fn digest(&self, bytes: &[u8]) -> String {
        crate::credential::hex(&mac(&self.digest_key, &[bytes]))
    }

    /// Whether `stored` is a sealed record (as opposed to a plain one an
    /// earlier version wrote).
    pub fn is_sealed(stored: &str) -> bool {
        stored.starts_with(PREFIX)
    }

    /// `plaintext` sealed for `record_id`: `sealed1:` then base64 of the
    /// nonce and the ciphertext with its tag.
    pub fn seal(&self, record_id: &str, plaintext: &[u8]) -> String {
        let mut nonce = [0; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        let nonce = XNonce::from(nonce);
        let sealed = self
            .cipher
            .encrypt(&nonce, Payload { msg: plaintext, aad: record_id.as_bytes() })
            // Encryption fails only for a message longer than 256 GiB.
            .unwrap_or_default();
        let mut bytes = nonce.to_vec();
        bytes.extend_from_slice(&sealed);
        format!("{PREFIX}{}", base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    /// Opens what [`Self::seal`] made for the same `record_id`.
    pub fn open(&self, record_id: &str, stored: &str) -> Result<Vec<u8>, OpenError> {
        let refused = || OpenError { record_id: record_id.to_owned() };
        let encoded = stored.strip_prefix(PREFIX).ok_or_else(refused)?;
        let bytes = base64::engine::general_purpose::STANDARD.decode(encoded).map_err(|_| refused())?;
        if bytes.len() < NONCE_LEN {
            return Err(refused());
        }
        let (nonce, sealed) = bytes.split_at(NONCE_LEN);
        let nonce = XNonce::try_from(nonce).map_err(|_| refused())?;
        self.cipher.decrypt(&nonce, Payload { msg: sealed, aad: record_id.as_bytes() }).map_err(|_| refused())
    }
}

/// What the digest key is derived under.
const DIGEST_KEY_LABEL: &[u8] = b"standby digest key v1";
/// What the key check is derived under.
const KEY_CHECK_LABEL: &[u8] = b"standby seal key check v1";

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC takes a key of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_is_keyed_stable_and_not_the_plain_hash() {
        use sha2::Digest;
        let key = SealKey::random();
        let body = br#"{"secrets":{"TOKEN":"hunter2"}}"#;
        assert_eq!(Sealer::new(&key).digest(body), Sealer::new(&key).digest(body), "stable under one key");
        assert_ne!(Sealer::new(&key).digest(body), Sealer::new(&SealKey::random()).digest(body), "keyed");
        assert_ne!(Sealer::new(&key).digest(body), Sealer::new(&key).digest(b"other"));
        assert_ne!(Sealer::new(&key).digest(body), crate::credential::hex(&Sha256::digest(body)));
        assert_eq!(Sealer::new(&key).digest(body).len(), 64);
    }

    #[test]
    fn a_sealed_record_opens_only_as_itself() {
        let sealer = Sealer::new(&SealKey::random());
        let sealed = sealer.seal("exe_1", b"the-secret-value");
        assert!(Sealer::is_sealed(&sealed));
        assert!(!sealed.contains("the-secret-value"));
        assert_eq!(sealer.open("exe_1", &sealed).expect("opens"), b"the-secret-value");
        assert_eq!(sealer.open("exe_2", &sealed), Err(OpenError { record_id: "exe_2".into() }), "bound to its id");
        let other = Sealer::new(&SealKey::random());
        assert!(other.open("exe_1", &sealed).is_err(), "bound to its key");
        let mut damaged = sealed.clone().into_bytes();
        let last = damaged.len() - 2;
        damaged[last] = if damaged[last] == b'A' { b'B' } else { b'A' };
        assert!(sealer.open("exe_1", &String::from_utf8(damaged).expect("ascii")).is_err(), "tamper-evident");
        assert_ne!(sealer.seal("exe_1", b"x"), sealer.seal("exe_1", b"x"), "a fresh nonce per record");
    }

    #[test]
    fn a_missing_key_file_is_generated_owner_only() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("keys/secret.key");
        let (key, generated) = SealKey::load_or_generate(&path).expect("generated");
        assert!(generated);
        assert_eq!(std::fs::metadata(&path).expect("exists").permissions().mode() & 0o777, 0o600);
        let (again, generated) = SealKey::load_or_generate(&path).expect("read back");
        assert!(!generated);
        assert_eq!(key.0, again.0);
        assert_eq!(format!("{key:?}"), "SealKey([REDACTED])");
        assert_eq!(format!("{:?}", Sealer::new(&key)), "Sealer([REDACTED])");
    }

    /// A replica on PostgreSQL loads a key and never makes one: a missing
    /// file names itself and the command that makes it; `keygen` never
    /// overwrites a key.
    #[test]
    fn a_key_that_must_exist_is_not_generated_and_keygen_never_overwrites() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("secret.key");
        let error = SealKey::load(&path).expect_err("missing");
        let message = error.to_string();
        assert!(matches!(error, KeyFileError::Missing { .. }), "{message}");
        assert!(
            message.contains(&path.display().to_string()) && message.contains("standby-server keygen"),
            "{message}"
        );
        assert!(!path.exists(), "nothing generated");
        let key = SealKey::generate(&path).expect("generated");
        assert_eq!(std::fs::metadata(&path).expect("exists").permissions().mode() & 0o777, 0o600);
        assert!(matches!(SealKey::generate(&path), Err(KeyFileError::Create { .. })), "never overwritten");
        assert_eq!(SealKey::load(&path).expect("loads").0, key.0);
    }

    #[test]
    fn a_key_check_is_stable_and_keyed() {
        let key = SealKey::random();
        assert_eq!(Sealer::new(&key).key_check(), Sealer::new(&key).key_check());
        assert_ne!(Sealer::new(&key).key_check(), Sealer::new(&SealKey::random()).key_check());
        assert_ne!(Sealer::new(&key).key_check(), Sealer::new(&key).digest(KEY_CHECK_LABEL), "not a digest");
    }

    #[test]
    fn a_short_or_garbled_key_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("secret.key");
        for text in ["", "abcd\n", &"g".repeat(64), &"a".repeat(63), &"a".repeat(66)] {
            std::fs::write(&path, text).expect("written");
            let error = SealKey::load_or_generate(&path).expect_err("refused");
            assert!(matches!(error, KeyFileError::Malformed { .. }), "{text:?}: {error}");
            assert!(error.to_string().contains(&path.display().to_string()), "{error}");
        }
        std::fs::write(&path, format!("  {}\n", "0f".repeat(32))).expect("written");
        assert!(SealKey::load_or_generate(&path).is_ok(), "whitespace around the digits is fine");
    }
}
