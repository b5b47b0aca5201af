use super::*;
use crate::source::manifests::fixtures::{SLICE, SVC, keys, lines, names, slice, svc};

#[test]
fn out_of_range_number_skips_only_its_document() {
    let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.0.0.1, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: big, namespace: x}\nspec: {ports: [{port: 99999999999999999999}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: c}\nspec: {clusterIP: 10.0.0.3, ports: [{port: 80}]}\n";
    let (objects, errors) = parse_documents("f.yaml", text);
    assert_eq!(objects.len(), 2, "{errors:?}");
    assert_eq!(errors.len(), 1, "{errors:?}");
    let msg = errors[0].to_string();
    assert!(
        msg.contains("document 2") && msg.contains("document skipped"),
        "{msg}"
    );
}

#[test]
fn multi_document_yaml() {
    let text = format!("---\n{SVC}---\n# only a comment\n---\n{SLICE}---\n");
    let (objects, errors) = parse_documents("a.yaml", &text);
    assert_eq!(lines(&errors), Vec::<String>::new());
    assert_eq!(
        keys(&objects),
        vec![
            ("Service", "shop".into(), "web".into()),
            ("EndpointSlice", "shop".into(), "web-abc".into())
        ]
    );
    assert_eq!(objects[0].origin(), "a.yaml");
    let Object::Service(s) = &objects[0] else {
        panic!()
    };
    assert_eq!(
        s.object.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
        80
    );
}

#[test]
fn empty_and_comment_only_files() {
    for text in ["", "\n", "# nothing\n", "---\n", "---\n---\n"] {
        let (objects, errors) = parse_documents("e.yaml", text);
        assert!(objects.is_empty(), "{text:?}");
        assert!(errors.is_empty(), "{text:?}: {errors:?}");
    }
    let (objects, errors) = parse_documents("e.json", "");
    assert!(objects.is_empty() && errors.is_empty());
}

#[test]
fn json_file_single_and_stream() {
    let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},
            "spec":{"clusterIP":"10.96.0.3","ports":[{"port":443}]}}
            {"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Service",
            "metadata":{"name":"k","namespace":"n"},"spec":{"clusterIP":"10.96.0.4"}}]}"#;
    let (objects, errors) = parse_documents("/m/svc.json", json);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        keys(&objects),
        vec![
            ("Service", "default".into(), "j".into()),
            ("Service", "n".into(), "k".into())
        ]
    );
    // Namespace defaulted on the object itself.
    let Object::Service(s) = &objects[0] else {
        panic!()
    };
    assert_eq!(s.object.metadata.namespace.as_deref(), Some("default"));
}

#[test]
fn invalid_json_keeps_earlier_values() {
    let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"}} {"apiVersion": "#;
    let (objects, errors) = parse_documents("x.JSON", json);
    assert_eq!(
        keys(&objects),
        vec![("Service", "default".into(), "j".into())]
    );
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0]
            .to_string()
            .starts_with("x.JSON: invalid JSON in document 2: "),
        "{}",
        errors[0]
    );
}

#[test]
fn yaml_syntax_error_mid_stream_keeps_earlier_documents() {
    let text = format!("{SVC}---\nkind: [unclosed\n---\n{SLICE}");
    let (objects, errors) = parse_documents("m.yaml", &text);
    assert_eq!(
        keys(&objects),
        vec![
            ("Service", "shop".into(), "web".into()),
            ("EndpointSlice", "shop".into(), "web-abc".into())
        ]
    );
    assert_eq!(errors.len(), 1, "{errors:?}");
    let line = errors[0].to_string();
    assert!(
        line.starts_with("m.yaml: invalid YAML in document 2: "),
        "{line}"
    );
    assert!(line.ends_with("document skipped"), "{line}");
    assert_eq!(errors[0].kind, "");
}

/// The review's case: Service `two` broken by a deleted `}` must not take Service
/// `one`'s slice (a later document) with it.
#[test]
fn yaml_broken_middle_document_keeps_the_others() {
    let two = svc("two").replacen("80}]}", "80}]", 1);
    let text = format!(
        "{}---\n{two}---\n{}---\n{}",
        svc("one"),
        slice("one-1", "one"),
        slice("two-1", "two")
    );
    let (objects, errors) = parse_documents("m.yaml", &text);
    assert_eq!(names(&objects), ["one", "one-1", "two-1"], "{errors:?}");
    assert_eq!(errors.len(), 1, "{errors:?}");
    let line = errors[0].to_string();
    assert!(
        line.starts_with("m.yaml: invalid YAML in document 2: "),
        "{line}"
    );
    // Positions are lines of the file, not of the piece: the broken `spec` is line 9.
    assert!(line.contains("at line 9 column"), "{line}");
}

#[test]
fn yaml_broken_first_or_last_document_keeps_the_others() {
    let bad = "apiVersion: v1\nkind: Service\nmetadata: {name: bad\n";
    let first = format!("{bad}---\n{}---\n{}", svc("one"), slice("one-1", "one"));
    let (objects, errors) = parse_documents("f.yaml", &first);
    assert_eq!(names(&objects), ["one", "one-1"], "{errors:?}");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0]
            .to_string()
            .starts_with("f.yaml: invalid YAML in document 1: "),
        "{}",
        errors[0]
    );

    // A leading `---` and a comment-only prelude do not count as documents.
    let last = format!(
        "# shop\n---\n{}---\n{}--- # the broken one\n{bad}",
        svc("one"),
        slice("one-1", "one")
    );
    let (objects, errors) = parse_documents("l.yaml", &last);
    assert_eq!(names(&objects), ["one", "one-1"], "{errors:?}");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0]
            .to_string()
            .starts_with("l.yaml: invalid YAML in document 3: "),
        "{}",
        errors[0]
    );
}

#[test]
fn yaml_several_broken_documents_each_reported() {
    let text = format!(
        "a: [\n---\n{}---\nb: {{\n---\n{}",
        svc("one"),
        slice("one-1", "one")
    );
    let (objects, errors) = parse_documents("s.yaml", &text);
    assert_eq!(names(&objects), ["one", "one-1"], "{errors:?}");
    let lines = lines(&errors);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].starts_with("s.yaml: invalid YAML in document 1: "));
    assert!(lines[1].starts_with("s.yaml: invalid YAML in document 3: "));
}

#[test]
fn yaml_entirely_garbage_file() {
    for text in ["{{{ ]]] :::\n\t- ][\n", "a: [\nb: }\n---\n: : {\n"] {
        let (objects, errors) = parse_documents("g.yaml", text);
        assert!(objects.is_empty(), "{text:?}");
        assert!(!errors.is_empty(), "{text:?}");
        for e in &errors {
            let line = e.to_string();
            assert!(
                line.starts_with("g.yaml: invalid YAML in document "),
                "{line}"
            );
        }
    }
}

#[test]
fn document_pieces_cut_at_markers_only() {
    let text = "a: 1\n---\nb: |\n  ---\n---x: 2\n--- # c\nd: 3\n---";
    let pieces = document_pieces(text);
    assert_eq!(
        pieces,
        vec![
            (1, "a: 1\n"),
            (2, "---\nb: |\n  ---\n---x: 2\n"),
            (6, "--- # c\nd: 3\n"),
            (8, "---"),
        ]
    );
    assert_eq!(document_pieces(""), vec![(1, "")]);
    assert_eq!(
        shift_lines("x at line 3 column 1, while parsing at line 1", 4),
        "x at line 7 column 1, while parsing at line 5"
    );
}
