//! Label and field selectors: a request's namespace, label and field requirements,
//! and whether an object matches them.

use serde_json::Value;

#[derive(Debug, Clone)]
enum Op {
    Eq,
    NotEq,
    Exists,
    NotExists,
}

/// Namespace, label and field requirements of one request.
#[derive(Debug, Clone, Default)]
pub(super) struct Filter {
    namespace: Option<String>,
    labels: Vec<(String, Op, String)>,
    fields: Vec<(String, Op, String)>,
}

impl Filter {
    pub(super) fn parse(
        ns: Option<String>,
        labels: Option<&str>,
        fields: Option<&str>,
    ) -> Result<Self, String> {
        let mut f = Filter {
            namespace: ns,
            ..Default::default()
        };
        if let Some(sel) = labels {
            if sel.contains('(') {
                return Err(format!(
                    "set-based label selectors are not supported by fakeapi: {sel:?}"
                ));
            }
            for term in sel.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                f.labels.push(parse_term(term, true)?);
            }
        }
        if let Some(sel) = fields {
            for term in sel.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                let req = parse_term(term, false)?;
                // `spec.nodeName` as the real server offers it for Pods (a node's agents
                // watch their own pods).
                if !matches!(
                    req.0.as_str(),
                    "metadata.name" | "metadata.namespace" | "spec.nodeName"
                ) {
                    return Err(format!("field label not supported: {}", req.0));
                }
                f.fields.push(req);
            }
        }
        Ok(f)
    }

    pub(super) fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        if self
            .namespace
            .as_ref()
            .is_some_and(|ns| meta["namespace"].as_str() != Some(ns.as_str()))
        {
            return false;
        }
        let labels = &meta["labels"];
        let label_ok = self.labels.iter().all(|(k, op, v)| {
            let have = labels.get(k).and_then(Value::as_str);
            match op {
                Op::Eq => have == Some(v.as_str()),
                Op::NotEq => have != Some(v.as_str()),
                Op::Exists => have.is_some(),
                Op::NotExists => have.is_none(),
            }
        });
        let field_ok = self.fields.iter().all(|(k, op, v)| {
            let have = match k.as_str() {
                "metadata.name" => meta["name"].as_str().unwrap_or(""),
                "spec.nodeName" => obj["spec"]["nodeName"].as_str().unwrap_or(""),
                _ => meta["namespace"].as_str().unwrap_or(""),
            };
            match op {
                Op::NotEq => have != v,
                _ => have == v,
            }
        });
        label_ok && field_ok
    }
}

fn parse_term(term: &str, allow_existence: bool) -> Result<(String, Op, String), String> {
    let split = |sep: &str, op: Op| {
        term.split_once(sep)
            .map(|(k, v)| (k.trim().to_owned(), op, v.trim().to_owned()))
    };
    let req = split("!=", Op::NotEq)
        .or_else(|| split("==", Op::Eq))
        .or_else(|| split("=", Op::Eq));
    match req {
        Some(r) if !r.0.is_empty() => Ok(r),
        Some(_) => Err(format!("invalid selector term: {term:?}")),
        None if allow_existence && term.contains(' ') => {
            Err(format!("unsupported selector term: {term:?}"))
        }
        None if allow_existence => match term.strip_prefix('!') {
            Some(k) => Ok((k.trim().to_owned(), Op::NotExists, String::new())),
            None => Ok((term.to_owned(), Op::Exists, String::new())),
        },
        None => Err(format!("invalid field selector term: {term:?}")),
    }
}
