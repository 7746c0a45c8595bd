//! Parse rules of the documents: lenient on absent and unknown fields, strict on the bytes
//! they write (the router's golden tests pin those against its rendering).

use serde_json::json;

use super::*;

#[test]
fn absent_fields_default_and_unknown_fields_are_ignored() {
    let doc = json!({
        "schema": "narwhal.lifecycle", "schema_version": 1,
        "router": {"controls_fleet": "active", "ready": true, "since": 12},
        "engines": {"e0": {"state": "drained", "ready_to_stop": true}},
        "added_later": {"x": 1},
    });
    let lc: Lifecycle = serde_json::from_value(doc).expect("parses");
    assert!(lc.is_lifecycle());
    assert_eq!(
        lc.router.controller, None,
        "an older router has no controller"
    );
    let e0 = lc.engine("e0").expect("e0");
    assert_eq!(e0.state, crate::handoff::DrainState::Drained);
    assert!(e0.ready_to_stop);
    assert_eq!(e0.deadline_at, None);
    assert_eq!(lc.error, "");
    let reply: LifecycleReply =
        serde_json::from_value(json!({"schema": "narwhal.lifecycle", "warnings": ["w"]}))
            .expect("parses");
    assert_eq!(reply.warnings.as_deref(), Some(&["w".to_string()][..]));
    assert!(reply.document.is_lifecycle());
    let other: Envelope = serde_json::from_str(r#"{"error": {"message": "m"}}"#).expect("parses");
    assert_eq!(other.schema, "", "not a versioned document");
}

#[test]
fn the_controller_fields_are_all_present_or_all_absent() {
    let off: State =
        serde_json::from_value(json!({"schema": "narwhal.state", "controller": "off"}))
            .expect("parses");
    assert_eq!(off.controller.controller, controller::OFF);
    assert_eq!(off.controller.fields, None);
    let text = serde_json::to_string(&off.controller).expect("serialises");
    assert_eq!(
        text, r#"{"controller":"off"}"#,
        "no field with the controller off"
    );
    let on: State = serde_json::from_value(json!({
        "schema": "narwhal.state", "controller": "reactive",
        "control": {"advisory": false, "last_decision": {
            "at": 1.5, "prefill": 1, "decode": 2, "by": "reactive", "reason": "r",
            "result": "held", "applied": false, "trigger_rid": null, "objective": 0.25}},
        "switching": ["e1"],
    }))
    .expect("parses");
    let f = on.controller.fields.expect("on");
    assert_eq!(f.switching, ["e1"]);
    let d = f.control.last_decision.expect("a decision");
    assert_eq!((d.prefill, d.decode, d.result.as_str()), (1, 2, "held"));
    let keys: Vec<&String> = d.details.keys().collect();
    assert_eq!(
        keys,
        ["trigger_rid", "objective"],
        "details keep their order"
    );
    let row = serde_json::to_string(&DecisionEvent::from(d)).expect("serialises");
    assert_eq!(
        row,
        r#"{"event":"controller_decision","at":1.5,"prefill":1,"decode":2,"by":"reactive","reason":"r","result":"held","applied":false,"trigger_rid":null,"objective":0.25}"#
    );
}

#[test]
fn warnings_are_absent_unless_set() {
    let reply = LifecycleReply::from(Lifecycle::default());
    let text = serde_json::to_string(&reply).expect("serialises");
    assert!(!text.contains("warnings"), "{text}");
    assert!(text.ends_with(r#""error":""}"#), "{text}");
    let reply = LifecycleReply {
        warnings: Some(Vec::new()),
        ..reply
    };
    let text = serde_json::to_string(&reply).expect("serialises");
    assert!(text.ends_with(r#""error":"","warnings":[]}"#), "{text}");
}
