//! The contract's HTTP calls as values: each one's route, method and
//! credential, and what the credential is presented for. One table, for the
//! agent that makes the calls and the servers that route them.

use crate::{CredentialKind, Purpose, SPEC_PATH, paths};

/// An HTTP method the contract uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    Get,
    Post,
}

impl Method {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Get => "GET",
            Self::Post => "POST",
        }
    }
}

/// One HTTP call of the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoint {
    /// `GET /v1/standby/spec`.
    Spec,
    Secrets,
    Attachments,
    /// One attachment's content at the path the reference server lists
    /// ([`paths::attachment`]).
    AttachmentFile,
    GitCredentials,
    Metadata,
    CloudCredentials,
    Events,
    Log,
}

impl Endpoint {
    pub const ALL: [Self; 9] = [
        Self::Spec,
        Self::Secrets,
        Self::Attachments,
        Self::AttachmentFile,
        Self::GitCredentials,
        Self::Metadata,
        Self::CloudCredentials,
        Self::Events,
        Self::Log,
    ];

    /// The path as a router's pattern (`{id}`, `{name}`).
    pub const fn route(self) -> &'static str {
        match self {
            Self::Spec => SPEC_PATH,
            Self::Secrets => paths::SECRETS_ROUTE,
            Self::Attachments => paths::ATTACHMENTS_ROUTE,
            Self::AttachmentFile => paths::ATTACHMENT_ROUTE,
            Self::GitCredentials => paths::GIT_CREDENTIALS_ROUTE,
            Self::Metadata => paths::METADATA_ROUTE,
            Self::CloudCredentials => paths::CLOUD_CREDENTIALS_ROUTE,
            Self::Events => paths::EVENTS_ROUTE,
            Self::Log => paths::LOG_ROUTE,
        }
    }

    pub const fn method(self) -> Method {
        match self {
            Self::GitCredentials | Self::CloudCredentials | Self::Events | Self::Log => Method::Post,
            Self::Spec | Self::Secrets | Self::Attachments | Self::AttachmentFile | Self::Metadata => Method::Get,
        }
    }

    /// The credential the call carries: the standby's for the spec, the
    /// run's for everything under `/v1/executions/{id}/`.
    pub const fn credential(self) -> CredentialKind {
        match self {
            Self::Spec => CredentialKind::Standby,
            _ => CredentialKind::Run,
        }
    }

    /// What the credential is presented for: a run's events and log are
    /// its reports, still accepted after a cancel (1.1).
    pub const fn purpose(self) -> Purpose {
        match self {
            Self::Events | Self::Log => Purpose::Report,
            _ => Purpose::Fetch,
        }
    }

    /// Whether the call is one of the install's network group, made
    /// concurrently once the assignment arrives.
    pub const fn is_install(self) -> bool {
        !matches!(self, Self::Spec | Self::Events | Self::Log)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_spec_is_asked_with_the_standby_credential() {
        for endpoint in Endpoint::ALL {
            let standby = endpoint.credential() == CredentialKind::Standby;
            assert_eq!(standby, endpoint == Endpoint::Spec, "{endpoint:?}");
            assert_eq!(standby, !endpoint.route().starts_with("/v1/executions/{id}/"), "{endpoint:?}");
        }
    }

    #[test]
    fn reports_are_posted_and_are_not_part_of_the_install() {
        for endpoint in [Endpoint::Events, Endpoint::Log] {
            assert_eq!((endpoint.method(), endpoint.purpose()), (Method::Post, Purpose::Report));
            assert!(!endpoint.is_install());
        }
    }
}
