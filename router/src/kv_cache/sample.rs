//! Which real requests the tokenizer agreement check samples (pure, no I/O; the driver is
//! `KvCache::sample_tokenizer`). The probe prompt checked at startup is one plain completion:
//! two engines can agree on it and still render a chat request differently (another chat
//! template, one that drops `tools`), so their prefix blocks never match while both look
//! `exact`. After a request's prompt was tokenized on one engine for its score, the same
//! `/tokenize` body is sometimes sent to another live engine and the tokens compared
//! (docs/design/kv-aware-placement.md, section 4):
//!
//! ```text
//! per request shape (completion, chat, chat with tools):
//!   an engine never checked for the shape   → check it (config order), once
//!   else every SAMPLE_EVERY-th request      → the next engine in rotation
//!   a check that could not be made          → the engine is unchecked again
//! ```

use serde_json::{Map, Value};

/// One request in this many of a shape is checked again once every engine was checked for
/// it: a relaunched engine with another template is caught within that many requests.
pub(crate) const SAMPLE_EVERY: u64 = 256;

/// What renders a request's prompt differently from one engine's template to another's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// A completion with a text prompt (the tokenizer alone).
    Completion,
    /// Chat messages without tools (the chat template).
    Chat,
    /// Chat messages with `tools` (the template's tool rendering).
    ChatWithTools,
}

impl Shape {
    /// Every shape, in the order `/narwhal/state` lists them.
    pub(crate) const ALL: [Shape; 3] = [Shape::Completion, Shape::Chat, Shape::ChatWithTools];

    /// The shape of a request body; `None` for a token-id prompt (never tokenized).
    pub(crate) fn of(body: &Map<String, Value>) -> Option<Shape> {
        if body.contains_key("messages") {
            let tools = body
                .get("tools")
                .and_then(Value::as_array)
                .is_some_and(|t| !t.is_empty());
            return Some(if tools {
                Shape::ChatWithTools
            } else {
                Shape::Chat
            });
        }
        match body.get("prompt") {
            Some(Value::String(_)) => Some(Shape::Completion),
            Some(Value::Array(a)) if a.iter().all(Value::is_string) => Some(Shape::Completion),
            _ => None,
        }
    }

    /// How a mismatch names it: `completion`, `chat`, `chat with tools`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Shape::Completion => "completion",
            Shape::Chat => "chat",
            Shape::ChatWithTools => "chat with tools",
        }
    }

    /// Its index in [`Shape::ALL`].
    pub(crate) fn slot(self) -> usize {
        Shape::ALL.iter().position(|s| *s == self).unwrap_or(0)
    }
}

/// Per shape: requests seen, engines checked, the rotation.
#[derive(Debug, Clone, Default)]
struct PerShape {
    seen: u64,
    checked: Vec<bool>,
    next: usize,
}

/// The sampling state over `engines` engines (config order).
#[derive(Debug, Clone)]
pub(crate) struct Sampler {
    shapes: [PerShape; 3],
    engines: usize,
}

impl Sampler {
    /// Nothing checked yet.
    pub(crate) fn new(engines: usize) -> Self {
        let fresh = PerShape {
            checked: vec![false; engines],
            ..PerShape::default()
        };
        Sampler {
            shapes: [fresh.clone(), fresh.clone(), fresh],
            engines,
        }
    }

    /// A request of `shape` was tokenized on engine `on`; the engine to check its tokens on,
    /// among `live` (config order), if this request is sampled: the first live engine never
    /// checked for the shape, else, on every [`SAMPLE_EVERY`]-th request, the next live
    /// engine in rotation. Never `on` itself. The engine returned counts as checked (so
    /// concurrent requests do not all sample it); [`Sampler::failed`] undoes that.
    ///
    /// `live` is asked only when this request may be sampled (an engine is unchecked for the
    /// shape, or it is the [`SAMPLE_EVERY`]-th): the common request reads no fleet state.
    pub(crate) fn pick(
        &mut self,
        shape: Shape,
        on: usize,
        live: impl FnOnce() -> Vec<usize>,
    ) -> Option<usize> {
        let s = &mut self.shapes[shape.slot()];
        s.seen += 1;
        if on < self.engines {
            // The engine that tokenized agrees with itself.
            s.checked[on] = true;
        }
        if s.checked.iter().all(|c| *c) && !s.seen.is_multiple_of(SAMPLE_EVERY) {
            return None;
        }
        let live = live();
        let others = || {
            live.iter()
                .copied()
                .filter(|e| *e != on && *e < s.checked.len())
        };
        if let Some(e) = others().find(|e| !s.checked[*e]) {
            s.checked[e] = true;
            return Some(e);
        }
        if !s.seen.is_multiple_of(SAMPLE_EVERY) {
            return None;
        }
        let n = self.engines.max(1);
        let start = s.next;
        let e = (0..n)
            .map(|k| (start + k) % n)
            .find(|e| others().any(|o| o == *e))?;
        s.next = (e + 1) % n;
        Some(e)
    }

    /// The check of engine `e` for `shape` could not be made (its `/tokenize` failed): it is
    /// picked again by a later request.
    pub(crate) fn failed(&mut self, shape: Shape, e: usize) {
        if let Some(c) = self.shapes[shape.slot()].checked.get_mut(e) {
            *c = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn shape(v: Value) -> Option<Shape> {
        Shape::of(v.as_object().expect("object"))
    }

    #[test]
    fn a_requests_shape_is_what_renders_its_prompt() {
        assert_eq!(shape(json!({"prompt": "hi"})), Some(Shape::Completion));
        assert_eq!(shape(json!({"prompt": ["hi"]})), Some(Shape::Completion));
        assert_eq!(shape(json!({"prompt": [1, 2]})), None);
        assert_eq!(shape(json!({"messages": []})), Some(Shape::Chat));
        assert_eq!(
            shape(json!({"messages": [], "tools": []})),
            Some(Shape::Chat)
        );
        assert_eq!(
            shape(json!({"messages": [], "tools": [{"type": "function"}]})),
            Some(Shape::ChatWithTools)
        );
        assert_eq!(Shape::ChatWithTools.as_str(), "chat with tools");
    }

    /// Each engine is checked once per shape, at the first request of the shape after it is
    /// live, never against itself; then one request in [`SAMPLE_EVERY`] is checked again, on
    /// the engines in turn; a failed check is made again by the next request.
    #[test]
    fn every_engine_is_checked_once_per_shape_then_in_turn() {
        let mut s = Sampler::new(3);
        let live = [0, 1, 2];
        assert_eq!(s.pick(Shape::Chat, 0, || live.to_vec()), Some(1));
        assert_eq!(s.pick(Shape::Chat, 0, || live.to_vec()), Some(2));
        assert_eq!(s.pick(Shape::Chat, 1, || live.to_vec()), None);
        // Another shape starts over.
        assert_eq!(s.pick(Shape::ChatWithTools, 2, || live.to_vec()), Some(0));
        s.failed(Shape::ChatWithTools, 0);
        assert_eq!(s.pick(Shape::ChatWithTools, 2, || live.to_vec()), Some(0));
        assert_eq!(s.pick(Shape::ChatWithTools, 2, || live.to_vec()), Some(1));
        // An engine that was not live is checked once it is.
        let mut s = Sampler::new(3);
        assert_eq!(s.pick(Shape::Completion, 0, || vec![0, 1]), Some(1));
        assert_eq!(s.pick(Shape::Completion, 0, || vec![0, 1]), None);
        assert_eq!(s.pick(Shape::Completion, 0, || live.to_vec()), Some(2));
        // Then every SAMPLE_EVERY-th request of the shape, in rotation, never the tokenizer.
        let mut picked = Vec::new();
        for _ in 3..=(3 * SAMPLE_EVERY) {
            if let Some(e) = s.pick(Shape::Completion, 0, || live.to_vec()) {
                picked.push(e);
            }
        }
        assert_eq!(picked, vec![1, 2, 1]);
        // A lone engine has nothing to be checked against.
        let mut s = Sampler::new(1);
        assert_eq!(s.pick(Shape::Chat, 0, || vec![0]), None);
    }
}
