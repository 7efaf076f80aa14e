//! One trust store for the control socket (wss) and every HTTP call
//! (https): the system's roots plus the certificates of `STANDBY_CA_FILE`.
//!
//! Both clients get the same [`rustls::ClientConfig`], so a server behind a
//! private CA works for both or for neither; before, tungstenite trusted a
//! compiled-in root list and reqwest the system's. The config offers no ALPN
//! protocol: the WebSocket upgrade needs HTTP/1.1, and the agent's few calls
//! gain nothing from HTTP/2.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::{ClientConfig, RootCertStore};

/// `STANDBY_CA_FILE` could not be used; the agent exits 2.
#[derive(Debug, thiserror::Error)]
#[error("invalid STANDBY_CA_FILE (--ca-file): {}: {problem}", path.display())]
pub struct CaFileError {
    pub path: PathBuf,
    pub problem: String,
}

/// Builds the agent's TLS client configuration: the system's roots (as
/// `rustls-native-certs` finds them, honouring `SSL_CERT_FILE` and
/// `SSL_CERT_DIR`) plus every certificate in `ca_file`.
pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, CaFileError> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, ignored) = roots.add_parsable_certificates(native.certs);
    if !native.errors.is_empty() {
        tracing::debug!(errors = native.errors.len(), "some system certificates could not be loaded");
    }
    tracing::debug!(added, ignored, "system trust roots loaded");
    if let Some(path) = ca_file {
        for certificate in read_ca_file(path)? {
            roots.add(certificate).map_err(|e| CaFileError {
                path: path.to_owned(),
                problem: format!("a certificate is not a usable trust anchor: {e}"),
            })?;
        }
    }
    if roots.is_empty() {
        tracing::warn!("no trusted root certificates: every https and wss connection will fail");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| CaFileError { path: ca_file.map(Path::to_owned).unwrap_or_default(), problem: e.to_string() })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

fn read_ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>, CaFileError> {
    let error = |problem: String| CaFileError { path: path.to_owned(), problem };
    let bytes = std::fs::read(path).map_err(|e| error(format!("cannot read it: {e}")))?;
    let certificates = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(format!("not PEM: {e}")))?;
    if certificates.is_empty() {
        return Err(error("it holds no PEM certificate (`-----BEGIN CERTIFICATE-----`)".into()));
    }
    Ok(certificates)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_ca_file_names_the_path() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let missing = dir.path().join("missing.pem");
        let error = client_config(Some(&missing)).expect_err("refused").to_string();
        assert!(error.contains("STANDBY_CA_FILE") && error.contains("missing.pem"), "{error}");

        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no certificate here\n").expect("write");
        let error = client_config(Some(&empty)).expect_err("refused").to_string();
        assert!(error.contains("empty.pem") && error.contains("no PEM certificate"), "{error}");

        let broken = dir.path().join("broken.pem");
        std::fs::write(&broken, "-----BEGIN CERTIFICATE-----\nnot base64 !!\n-----END CERTIFICATE-----\n")
            .expect("write");
        let error = client_config(Some(&broken)).expect_err("refused").to_string();
        assert!(error.contains("broken.pem"), "{error}");
    }

    #[test]
    fn without_a_ca_file_the_system_roots_suffice() {
        client_config(None).expect("a configuration");
    }
}
