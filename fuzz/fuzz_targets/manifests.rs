//! Arbitrary bytes as a manifest file, read as multi-document YAML and as a JSON stream:
//! the parser never panics, and every object it returns is usable by the model (see
//! `proxy_fuzz::check_objects`).

#![no_main]

use libfuzzer_sys::fuzz_target;
use proxy_userspace::source::manifests::parse_documents;

fuzz_target!(|data: &[u8]| {
    // The directory source skips a non-UTF-8 file whole; lossy decoding keeps the rest of
    // the input useful to the parser.
    let text = String::from_utf8_lossy(data);
    for origin in ["fuzz.yaml", "fuzz.json"] {
        let (objects, errors) = parse_documents(origin, &text);
        proxy_fuzz::check_objects(origin, &objects, &errors);
        // Parsing is a function of the text.
        assert_eq!(
            parse_documents(origin, &text),
            (objects, errors),
            "{origin}"
        );
    }
});
