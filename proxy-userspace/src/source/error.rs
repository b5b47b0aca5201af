//! The errors of sources: one object or file skipped, or a warning about one. A leaf: it
//! imports nothing of the crate, so the model can report its own skipped objects with the
//! same type (`model::ModelError`).

use std::fmt;

/// One object or file skipped (or a warning about one), with a message that names file,
/// kind, namespace/name and reason. Fields that are unknown are empty strings.
///
/// Every `SourceError` describes something the agent worked around (the object, the port
/// or the endpoint is skipped; the rest keeps working), so callers log them at warning
/// level; none is fatal.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SourceError {
    /// File (or "api") the object came from.
    pub origin: String,
    /// Kind of the object (`Service`, `EndpointSlice`, ...), empty when unknown.
    pub(crate) kind: String,
    /// Namespace of the object, empty when unknown.
    pub(crate) namespace: String,
    /// Name of the object, empty when unknown.
    pub(crate) name: String,
    /// What is wrong and what was skipped.
    pub reason: String,
}

impl SourceError {
    /// An error about a whole file (or directory).
    pub(crate) fn file(origin: impl Into<String>, reason: impl Into<String>) -> Self {
        SourceError {
            origin: origin.into(),
            reason: reason.into(),
            ..Default::default()
        }
    }

    /// An error about one object.
    pub(crate) fn object(
        origin: impl Into<String>,
        kind: impl Into<String>,
        namespace: impl Into<String>,
        name: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        SourceError {
            origin: origin.into(),
            kind: kind.into(),
            namespace: namespace.into(),
            name: name.into(),
            reason: reason.into(),
        }
    }
}

/// One line: `<file>: <Kind> <ns>/<name>: <reason>`, leaving out the parts that are unknown
/// (`<file>: <reason>` for an unparseable file, `<file>: <Kind>: <reason>` for an object
/// without a name).
impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut wrote = false;
        if !self.origin.is_empty() {
            f.write_str(&self.origin)?;
            wrote = true;
        }
        let mut object = String::new();
        if !self.kind.is_empty() {
            object.push_str(&self.kind);
        }
        if !self.name.is_empty() {
            if !object.is_empty() {
                object.push(' ');
            }
            if !self.namespace.is_empty() {
                object.push_str(&self.namespace);
                object.push('/');
            }
            object.push_str(&self.name);
        }
        if !object.is_empty() {
            if wrote {
                f.write_str(": ")?;
            }
            f.write_str(&object)?;
            wrote = true;
        }
        if wrote {
            f.write_str(": ")?;
        }
        f.write_str(&self.reason)
    }
}

impl std::error::Error for SourceError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_omits_unknown_parts() {
        assert_eq!(
            SourceError::file("f.yaml", "boom").to_string(),
            "f.yaml: boom"
        );
        assert_eq!(
            SourceError::object("f.yaml", "Service", "a", "b", "r").to_string(),
            "f.yaml: Service a/b: r"
        );
        assert_eq!(
            SourceError::object("f.yaml", "Service", "", "", "r").to_string(),
            "f.yaml: Service: r"
        );
        assert_eq!(
            SourceError::object("", "Service", "a", "b", "r").to_string(),
            "Service a/b: r"
        );
        assert_eq!(SourceError::file("", "r").to_string(), "r");
    }
}
