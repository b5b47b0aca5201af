//! Where a configuration file's errors are: the line of a field named by its dotted path or
//! of a repeated key, and serde's type errors in words, without Rust's type names.

/// The 1-based line of the key at the dotted `path` (`conntrack.maxPerCore`) in a block-style
/// YAML document: the first segment at the top level, each next one inside the previous
/// key's block. `None` when the text has no such key in that style (a flow mapping, a quoted
/// key) or `path` is not a field path.
pub(crate) fn field_line(text: &str, path: &str) -> Option<usize> {
    let segments: Vec<&str> = path.split('.').collect();
    if segments
        .iter()
        .any(|s| s.is_empty() || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
    {
        return None;
    }
    let mut depth = 0;
    // The indentation of the last matched key: the next segment must be deeper.
    let mut parent: Option<usize> = None;
    for (i, l) in text.lines().enumerate() {
        let key = l.trim_start();
        if key.is_empty() || key.starts_with('#') || key.starts_with("---") {
            continue;
        }
        let indent = l.len() - key.len();
        match parent {
            // Left the matched key's block without finding the next segment.
            Some(p) if indent <= p => return None,
            None if indent > 0 => continue,
            _ => {}
        }
        if key
            .strip_prefix(segments[depth])
            .is_some_and(|rest| rest.trim_start().starts_with(':'))
        {
            depth += 1;
            if depth == segments.len() {
                return Some(i + 1);
            }
            parent = Some(indent);
        }
    }
    None
}

/// The 1-based line of the second `name:` key at one indentation, from line `from` on
/// (the start of the mapping serde named): where a duplicate key is. `None` when the text
/// has no such pair (a flow mapping, a quoted key).
pub(super) fn duplicate_key_line(text: &str, name: &str, from: usize) -> Option<usize> {
    let mut seen = std::collections::HashSet::new();
    for (i, l) in text.lines().enumerate().skip(from.saturating_sub(1)) {
        let key = l.trim_start();
        let indent = l.len() - key.len();
        if key
            .strip_prefix(name)
            .is_some_and(|rest| rest.trim_start().starts_with(':'))
            && !seen.insert(indent)
        {
            return Some(i + 1);
        }
    }
    None
}

/// A serde or YAML error message without Rust's type names: "invalid type: string "yes",
/// expected a boolean at line 3 column 5" becomes "expected true or false, found the
/// string "yes"". Messages of other shapes are kept, without their position.
pub fn plain_type_error(msg: &str) -> String {
    let msg = match msg.rfind(" at line ") {
        Some(i) if msg[i..].contains(" column ") => &msg[..i],
        _ => msg,
    };
    let Some(rest) = msg.strip_prefix("invalid type: ") else {
        return msg.to_string();
    };
    let Some((found, expected)) = rest.rsplit_once(", expected ") else {
        return msg.to_string();
    };
    let expected = match expected.trim() {
        "a boolean" => "true or false".to_string(),
        "a string" | "a borrowed string" | "a character" => "a string".to_string(),
        "a sequence" => "a list".to_string(),
        "a map" => "a mapping of names to values".to_string(),
        e if e.starts_with("struct ") => "a mapping of fields".to_string(),
        "u8" | "u16" | "u32" | "u64" | "i8" | "i16" | "i32" | "i64" | "an integer" => {
            "a whole number".to_string()
        }
        "f32" | "f64" => "a number".to_string(),
        e => e.to_string(),
    };
    // serde_yaml_ng reports an integer beyond 64 bits as "integer `N` as u128" (or i128),
    // expecting "any YAML value": it is a whole number too large for any field.
    let (found, expected) = match found
        .strip_suffix(" as u128")
        .or_else(|| found.strip_suffix(" as i128"))
    {
        Some(f) => (f, "a whole number that fits its field".to_string()),
        None => (found, expected),
    };
    let found = if let Some(v) = found.strip_prefix("string ") {
        format!("the string {v}")
    } else if let Some(v) = found
        .strip_prefix("integer ")
        .or_else(|| found.strip_prefix("floating point "))
    {
        format!("the number {}", v.trim_matches('`'))
    } else if let Some(v) = found.strip_prefix("boolean ") {
        format!("the boolean {}", v.trim_matches('`'))
    } else {
        match found {
            "sequence" => "a list".to_string(),
            "map" => "a mapping".to_string(),
            "unit value" => "null".to_string(),
            other => other.to_string(),
        }
    };
    format!("expected {expected}, found {found}")
}
