use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A credential or secret value.
///
/// `Debug` and `Display` print `[REDACTED]`, so a value that ends up in a log
/// line, an error message or a panic shows nothing. The only way to the bytes
/// is [`Secret::expose`], which makes every use greppable.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret value itself; never pass it to a logger.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[REDACTED]")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[REDACTED]")
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self::new(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_hide_the_value() {
        let secret = Secret::new("hunter2");
        assert_eq!(format!("{secret:?}"), "[REDACTED]");
        assert_eq!(format!("{secret}"), "[REDACTED]");
        assert_eq!(format!("{:?}", Some(&secret)), "Some([REDACTED])");
        assert_eq!(secret.expose(), "hunter2");
    }

    #[test]
    fn serializes_as_a_plain_string() {
        let secret: Secret = serde_json::from_str("\"abc\"").expect("a JSON string");
        assert_eq!(serde_json::to_string(&secret).expect("serializes"), "\"abc\"");
    }
}
