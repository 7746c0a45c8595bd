use super::*;
use serde_json::json;

const SPECIALS: [&str; 6] = [
    "<s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
];
const WORDS: [&str; 14] = [
    "hello", "world", "you", "are", "kind", "get", "weather", "name", "x", "{", "}", "\"", ":", ",",
];
/// The tiny model's template (system, multi-turn, generation prompt).
const TINY: &str = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

/// A word-level tokenizer.json: `<s>` added before a completion's prompt (a
/// `TemplateProcessing` post-processor, as Llama's), the specials matched whole.
fn tokenizer_json() -> String {
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (i, t) in SPECIALS.iter().enumerate() {
        vocab.insert((*t).into(), json!(i));
        added.push(
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}),
        );
    }
    vocab.insert("[UNK]".into(), json!(SPECIALS.len()));
    for (i, w) in WORDS.iter().enumerate() {
        vocab.insert((*w).into(), json!(SPECIALS.len() + 1 + i));
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
    .to_string()
}

fn model(template: Option<&str>, jinja_file: Option<&str>) -> (tempfile::TempDir, ModelTokenizer) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer_json()).expect("write");
    let mut cfg = json!({"bos_token": "<s>", "eos_token": {"content": "<|end|>"}});
    if let Some(t) = template {
        cfg["chat_template"] = json!(t);
    }
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).expect("write");
    if let Some(t) = jinja_file {
        std::fs::write(dir.path().join("chat_template.jinja"), t).expect("write");
    }
    let m = ModelTokenizer::load(dir.path()).expect("load");
    (dir, m)
}

fn body(v: Value) -> Map<String, Value> {
    v.as_object().cloned().expect("object")
}

#[test]
fn a_completion_gets_the_tokenizers_bos_unless_told_not_to() {
    let (_d, m) = model(None, None);
    assert!(!m.has_chat_template());
    assert_eq!(
        m.tokens(&body(json!({"prompt": "hello world"}))),
        Ok(vec![0, 7, 8])
    );
    assert_eq!(
        m.tokens(&body(
            json!({"prompt": "hello zzz", "add_special_tokens": false})
        )),
        Ok(vec![7, 6])
    );
    assert_eq!(
        m.tokens(&body(json!({"messages": []}))),
        Err(RenderError::Unsupported("the model has no chat template"))
    );
    assert_eq!(
        m.tokens(&body(json!({"prompt": 3}))),
        Err(RenderError::Shape("prompt"))
    );
}

#[test]
fn a_chat_renders_system_and_turns_with_the_generation_prompt_and_no_bos() {
    let (_d, m) = model(Some(TINY), None);
    let chat = body(json!({"messages": [
        {"role": "system", "content": "you are kind"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]}));
    assert_eq!(
        m.render_chat(&chat).expect("render"),
        "<|system|>\nyou are kind<|end|>\n<|user|>\nhello<|end|>\n<|assistant|>\nworld<|end|>\n<|user|>\nhello\nworld<|end|>\n<|assistant|>\n"
    );
    let tokens = m.tokens(&chat).expect("tokens");
    assert_eq!(
        tokens.first(),
        Some(&1),
        "no BOS: the template's own text starts the prompt"
    );
    let mut without = chat.clone();
    without.insert("add_generation_prompt".into(), json!(false));
    assert!(
        !m.render_chat(&without)
            .expect("render")
            .ends_with("<|assistant|>\n")
    );
}

#[test]
fn continue_final_message_stops_where_the_final_message_ends() {
    let (_d, m) = model(Some(TINY), None);
    let chat = body(json!({"messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}],
        "continue_final_message": true, "add_generation_prompt": false}));
    assert_eq!(
        m.render_chat(&chat).expect("render"),
        "<|user|>\nhello<|end|>\n<|assistant|>\nworld"
    );
    let mut both = chat.clone();
    both.remove("add_generation_prompt");
    assert_eq!(
        m.render_chat(&both),
        Err(RenderError::Shape("continue_final_message"))
    );
}

#[test]
fn tools_render_through_tojson_and_a_template_can_refuse() {
    let t = "{% if tools %}<|tool|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}\
        {% for m in messages %}{% if m.role == 'user' and loop.index0 % 2 == 1 %}{{ raise_exception('roles must alternate') }}{% endif %}\
        <|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}";
    let (_d, m) = model(Some(t), None);
    let chat = body(json!({"messages": [{"role": "user", "content": "hello"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"x": 1.0}}}]}));
    assert_eq!(
        m.render_chat(&chat).expect("render"),
        "<|tool|>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": null, \"parameters\": {\"x\": 1.0}}}\n<|user|>\nhello<|end|>\n"
    );
    let two = body(
        json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
    );
    match m.render_chat(&two) {
        Err(RenderError::Template(e)) => assert!(e.contains("roles must alternate"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn kwargs_reach_the_template_as_vllm_passes_them() {
    // Booleans print as Python prints them.
    let t = "{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}|{{ reasoning_effort }}|{{ flavour is defined }}|{{ documents | length }}";
    let (_d, m) = model(Some(t), None);
    let chat = body(json!({"messages": [], "reasoning_effort": "none",
        "chat_template_kwargs": {"flavour": "auto", "tokenize": true}, "documents": [{"text": "d"}]}));
    assert_eq!(
        m.render_chat(&chat).expect("render"),
        "<s>|<|end|>|False|none|False|1"
    );
    let mut own = chat.clone();
    own.insert("chat_template".into(), json!("{{ x }}"));
    assert!(matches!(
        m.render_chat(&own),
        Err(RenderError::Unsupported(_))
    ));
}

#[test]
fn named_templates_give_tool_requests_the_tool_use_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer_json()).expect("write");
    let cfg = json!({"chat_template": [{"name": "default", "template": "plain"},
                                       {"name": "tool_use", "template": "tools:{{ tools | length }}"}]});
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).expect("write");
    let m = ModelTokenizer::load(dir.path()).expect("load");
    assert_eq!(
        m.render_chat(&body(json!({"messages": []})))
            .expect("render"),
        "plain"
    );
    let tools = json!({"messages": [], "tools": [{"type": "function", "function": {"name": "f"}}]});
    assert_eq!(m.render_chat(&body(tools)).expect("render"), "tools:1");
}

#[test]
fn the_request_fields_win_over_its_kwargs_as_in_a_chat_completion() {
    let t = "{{ reasoning_effort }}|{{ enable_thinking is defined }}|{{ documents | length }}";
    let (_d, m) = model(Some(t), None);
    let chat = body(
        json!({"messages": [], "reasoning_effort": "high", "documents": [1, 2],
        "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": null, "documents": [1]}}),
    );
    // enable_thinking named (even as null) is not derived; null is then dropped.
    assert_eq!(m.render_chat(&chat).expect("render"), "high|False|2");
}

#[test]
fn a_chat_template_file_wins_over_the_config_and_a_broken_one_is_named() {
    let (_d, m) = model(Some(TINY), Some("file:{{ messages | length }}"));
    assert_eq!(
        m.render_chat(&body(json!({"messages": []})))
            .expect("render"),
        "file:0"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer_json()).expect("write");
    std::fs::write(dir.path().join("chat_template.jinja"), "{% for %}").expect("write");
    // A template minijinja cannot compile is named, and chat goes to the engines.
    let broken = ModelTokenizer::load(dir.path()).expect("loads");
    assert!(!broken.has_chat_template());
    let err = broken.template_error().unwrap_or_default();
    assert!(err.contains("chat_template.jinja"), "{err}");
    assert!(matches!(
        broken.render_chat(&body(json!({"messages": []}))),
        Err(RenderError::Template(_))
    ));
    assert!(broken.tokens(&body(json!({"prompt": "hello"}))).is_ok());
    let missing = ModelTokenizer::load(&dir.path().join("nope")).expect_err("missing");
    assert!(missing.to_string().contains("tokenizer.json"), "{missing}");
}
