//! Handoff documents (the standby's `GET /narwhal/handoff` body, `--resume`) and the state
//! file they are persisted to (`recovery.state_path`).

use narwhal_shared::handoff::{Handoff, Loaded, load_state_file, write_state_file};

/// Checks one document's text.
///
/// # Panics
/// When a parsed document does not render to text that parses to the same document, or
/// does not survive a write and a load of the state file.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(h) = Handoff::parse(text) else {
        return;
    };
    let rendered = serde_json::to_string(&h).expect("a handoff serialises");
    let again = Handoff::parse(&rendered)
        .unwrap_or_else(|e| panic!("a rendered handoff is refused: {e}\n{rendered}"));
    assert_eq!(h, again, "parse -> render -> parse changed the document");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("state.json");
    write_state_file(&path, &h).expect("a valid handoff is written");
    match load_state_file(&path) {
        Loaded::Valid(loaded) => assert_eq!(*loaded, h, "the state file changed the document"),
        other => panic!("a written state file does not load: {other:?}"),
    }
}
