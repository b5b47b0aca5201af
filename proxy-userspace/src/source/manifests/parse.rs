//! The text of one manifest file to objects: a JSON stream, or multi-document YAML cut
//! into its documents (a broken document skips only itself); each document goes to
//! [`super::document`].

use serde::Deserialize;
use serde_json::Value;

use super::document::{dispatch, plain_object};
use crate::source::{Object, SourceError};

/// Parses the text of one manifest file. `origin` names the file in errors; when it ends in
/// `.json` (any case) the text is parsed as a JSON stream, otherwise as multi-document YAML.
/// Returns the objects in document order and the errors of everything skipped.
pub fn parse_documents(origin: &str, text: &str) -> (Vec<Object>, Vec<SourceError>) {
    let mut objects = Vec::new();
    let mut errors = Vec::new();
    if origin.to_ascii_lowercase().ends_with(".json") {
        for (i, doc) in serde_json::Deserializer::from_str(text)
            .into_iter::<&serde_json::value::RawValue>()
            .enumerate()
        {
            match doc {
                Ok(raw) => match plain_object(origin, raw.get()) {
                    Some(object) => objects.push(object),
                    // Everything else (lists, errors) through the general path, which
                    // words the errors.
                    None => match serde_json::from_str::<Value>(raw.get()) {
                        Ok(value) => {
                            dispatch(origin, i + 1, value, None, &mut objects, &mut errors)
                        }
                        Err(e) => errors.push(SourceError::file(
                            origin,
                            format!("invalid JSON in document {}: {e}; document skipped", i + 1),
                        )),
                    },
                },
                Err(e) => {
                    errors.push(SourceError::file(
                        origin,
                        format!(
                            "invalid JSON in document {}: {e}; rest of the file skipped",
                            i + 1
                        ),
                    ));
                    break;
                }
            }
        }
    } else {
        parse_yaml(origin, text, &mut objects, &mut errors);
    }
    (objects, errors)
}

/// Parses multi-document YAML. The whole text is read as one stream first; serde_yaml's
/// stream ends at a syntax error, so when it hits one, the text is parsed again piece by
/// piece, cut before every line that starts a document (`---` at column 0, see
/// [`document_pieces`]): a broken document then loses only itself.
fn parse_yaml(origin: &str, text: &str, objects: &mut Vec<Object>, errors: &mut Vec<SourceError>) {
    let mut whole = (Vec::new(), Vec::new());
    if parse_yaml_stream(origin, text, 0, 1, &mut whole.0, &mut whole.1).is_ok() {
        objects.append(&mut whole.0);
        errors.append(&mut whole.1);
        return;
    }
    let mut documents = 0;
    for (line, piece) in document_pieces(text) {
        // Comments before the first `---` are no document (the parser would see an empty one).
        let prelude = !piece.starts_with("---")
            && piece.lines().all(|l| {
                let l = l.trim();
                l.is_empty() || l.starts_with('#') || l.starts_with('%')
            });
        if prelude {
            continue;
        }
        match parse_yaml_stream(origin, piece, documents, line, objects, errors) {
            Ok(n) => documents += n,
            Err(n) => documents += n + 1,
        }
    }
}

/// Cuts YAML text before every line that starts with the document marker `---` followed by
/// the end of the line, a space or a tab. YAML forbids such a line inside any content (block
/// scalars are indented, quoted scalars may not hold it at column 0), so each piece holds at
/// most one document; the first may hold none (only comments or directives). Returns the
/// 1-based line number where each piece starts, and the piece.
fn document_pieces(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let (mut start, mut start_line, mut pos) = (0, 1, 0);
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let rest = line.strip_prefix("---");
        let marker = rest.is_some_and(|r| {
            r.is_empty() || r.starts_with([' ', '\t', '\n']) || r == "\r\n" || r == "\r"
        });
        if marker && pos > start {
            out.push((start_line, &text[start..pos]));
            start = pos;
            start_line = i + 1;
        }
        pos += line.len();
    }
    if pos > start || out.is_empty() {
        out.push((start_line, &text[start..]));
    }
    out
}

/// Reads the documents of `text`, numbering them from `before + 1` in errors (`first_line`
/// is where `text` starts in the file, named in syntax errors of a piece). Returns the number
/// of documents read, or at a syntax error the number read before it (the error is pushed).
fn parse_yaml_stream(
    origin: &str,
    text: &str,
    before: usize,
    first_line: usize,
    objects: &mut Vec<Object>,
    errors: &mut Vec<SourceError>,
) -> Result<usize, usize> {
    let mut read = 0;
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let number = before + read + 1;
        // Through a YAML value first: a document that is valid YAML but not valid JSON
        // (a number out of range, a non-string key) is skipped alone.
        match serde_yaml_ng::Value::deserialize(doc) {
            Ok(yaml) => match serde_json::to_value(&yaml) {
                Ok(value) => dispatch(origin, number, value, None, objects, errors),
                Err(e) => {
                    let get = |f: &str| {
                        yaml.get(f)
                            .and_then(|v| v.as_str())
                            .unwrap_or("")
                            .to_string()
                    };
                    let meta = |f: &str| {
                        yaml.get("metadata")
                            .and_then(|m| m.get(f))
                            .and_then(|v| v.as_str())
                            .unwrap_or("")
                            .to_string()
                    };
                    let ns = if meta("namespace").is_empty() {
                        "default".to_string()
                    } else {
                        meta("namespace")
                    };
                    errors.push(SourceError::object(
                        origin,
                        get("kind"),
                        ns,
                        meta("name"),
                        format!("document {number} cannot be read: {e}; object skipped"),
                    ));
                }
            },
            Err(e) => {
                let msg = e.to_string();
                // A value YAML cannot represent (an integer beyond 64 bits) spoils only
                // its document; a syntax error ends the stream.
                if msg.contains("invalid type") || msg.contains("invalid value") {
                    errors.push(SourceError::file(
                        origin,
                        format!("document {number} cannot be read: {msg}; document skipped"),
                    ));
                    read += 1;
                    continue;
                }
                let msg = shift_lines(&msg, first_line - 1);
                errors.push(SourceError::file(
                    origin,
                    format!("invalid YAML in document {number}: {msg}; document skipped"),
                ));
                return Err(read);
            }
        }
        read += 1;
    }
    Ok(read)
}

/// Adds `offset` to every "line N" of a YAML error message, so that positions in a piece
/// of a file name lines of the file.
fn shift_lines(msg: &str, offset: usize) -> String {
    if offset == 0 {
        return msg.to_string();
    }
    let mut out = String::with_capacity(msg.len() + 8);
    let mut rest = msg;
    while let Some(i) = rest.find("line ") {
        out.push_str(&rest[..i + 5]);
        rest = &rest[i + 5..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        match rest[..digits].parse::<usize>() {
            Ok(n) => out.push_str(&(n + offset).to_string()),
            Err(_) => out.push_str(&rest[..digits]),
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests;
