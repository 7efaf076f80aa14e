//! `labelSelector` and `fieldSelector` as list and watch take them.
//!
//! Labels: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`,
//! comma-joined (all must hold). Fields: `path=v`, `path==v`, `path!=v` on
//! any dotted path of the object (`metadata.name`, `status.phase`); the real
//! server allows only a few paths per kind, the fake allows any.

use serde_json::Value;

use super::error::ApiError;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Eq(String, String),
    NotEq(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed selector (labels or fields), empty = everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    labels: Vec<Requirement>,
    fields: Vec<Requirement>,
}

/// Splits on commas outside parentheses.
fn split_terms(s: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&s[start..]);
    terms.into_iter().map(str::trim).filter(|t| !t.is_empty()).collect()
}

fn set_values(rest: &str, term: &str) -> Result<Vec<String>, ApiError> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| ApiError::BadRequest(format!("unable to parse requirement: {term}")))?;
    Ok(inner.split(',').map(|v| v.trim().to_owned()).filter(|v| !v.is_empty()).collect())
}

fn parse_term(term: &str, sets: bool) -> Result<Requirement, ApiError> {
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(Requirement::NotEq(k.trim().into(), v.trim().into()));
    }
    if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(Requirement::Eq(k.trim().into(), v.trim().into()));
    }
    if sets {
        if let Some((k, rest)) = term.split_once(" notin ") {
            return Ok(Requirement::NotIn(k.trim().into(), set_values(rest, term)?));
        }
        if let Some((k, rest)) = term.split_once(" in ") {
            return Ok(Requirement::In(k.trim().into(), set_values(rest, term)?));
        }
        if let Some(k) = term.strip_prefix('!') {
            return Ok(Requirement::NotExists(k.trim().into()));
        }
        if !term.contains(char::is_whitespace) {
            return Ok(Requirement::Exists(term.into()));
        }
    }
    Err(ApiError::BadRequest(format!("unable to parse requirement: {term}")))
}

impl Selector {
    pub fn parse(labels: Option<&str>, fields: Option<&str>) -> Result<Self, ApiError> {
        let labels = labels.map(split_terms).unwrap_or_default();
        let fields = fields.map(split_terms).unwrap_or_default();
        Ok(Self {
            labels: labels.into_iter().map(|t| parse_term(t, true)).collect::<Result<_, _>>()?,
            fields: fields.into_iter().map(|t| parse_term(t, false)).collect::<Result<_, _>>()?,
        })
    }

    pub fn matches(&self, obj: &Value) -> bool {
        let label = |k: &str| obj.pointer("/metadata/labels").and_then(|l| l.get(k)).and_then(Value::as_str);
        let field = |path: &str| {
            let mut v = obj;
            for part in path.split('.') {
                match v.get(part) {
                    Some(next) => v = next,
                    None => return Some(String::new()),
                }
            }
            Some(match v {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            })
        };
        self.labels.iter().all(|r| holds(r, &|k| label(k).map(str::to_owned)))
            && self.fields.iter().all(|r| holds(r, &field))
    }
}

fn holds(r: &Requirement, get: &dyn Fn(&str) -> Option<String>) -> bool {
    match r {
        Requirement::Eq(k, v) => get(k).as_deref() == Some(v.as_str()),
        Requirement::NotEq(k, v) => get(k).as_deref() != Some(v.as_str()),
        Requirement::Exists(k) => get(k).is_some(),
        Requirement::NotExists(k) => get(k).is_none(),
        Requirement::In(k, vs) => get(k).is_some_and(|v| vs.contains(&v)),
        Requirement::NotIn(k, vs) => get(k).is_none_or(|v| !vs.contains(&v)),
    }
}
