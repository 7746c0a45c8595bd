//! The router's own tokenizer (`engine.tokenizer`) and its agreement with the engines (pure
//! state; the driver is `KvCache::tokens` / `KvCache::check_local`;
//! docs/design/kv-aware-placement.md, "The router's tokenizer"):
//!
//! ```text
//! request of shape S ──S not mismatched──► ModelTokenizer::tokens ──ok──► tokens (no engine asked)
//!        │                                        └─cannot render──► /tokenize (counted fallback)
//!        └─S mismatched───────────────────────────────────────────► /tokenize
//! sampled (each engine once per shape, then 1 in SAMPLE_EVERY): the engine's /tokenize of the
//! same request, off the request path ──differs──► S mismatched (warned, shown, kept until restart)
//! ```
//!
//! A mismatch is per shape: a template's tool rendering that differs from vLLM's sends only
//! tool-calling requests back to `/tokenize`. Whether the engines agree with each other is the
//! engine check's business ([`super::sample`]), which runs as before on every request
//! tokenized by an engine.

use std::sync::Arc;

use narwhal_tokenizer::{ModelTokenizer, RenderError};
use serde_json::{Map, Value};

use super::sample::{Sampler, Shape};
use super::{KvCache, live_loads, tokenize_body};
use crate::fleet::Fleet;

/// Prompt text (characters) above which the tokens are computed on the blocking pool rather
/// than on the request's runtime thread: about 2,000 tokens, some 1.5 ms of one core in a
/// release build (docs/benchmarks.md, "The router's tokenizer"), long enough to delay the
/// other connections that thread serves; below it the hand-off would cost more than it saves.
const INLINE_CHARS: usize = 8 * 1024;

/// The characters of a body's prompt text: its string `prompt`, or its messages' string
/// contents and text parts (what the tokenizer's time grows with).
fn prompt_chars(body: &Map<String, Value>) -> usize {
    fn text(v: &Value) -> usize {
        match v {
            Value::String(s) => s.len(),
            Value::Array(a) => a.iter().map(text).sum(),
            Value::Object(o) => o.get("text").or_else(|| o.get("content")).map_or(0, text),
            _ => 0,
        }
    }
    body.get("prompt")
        .or_else(|| body.get("messages"))
        .map_or(0, text)
}

/// `model`'s tokens for `body` ([`ModelTokenizer::tokens`]), computed on tokio's blocking pool
/// when the prompt is longer than [`INLINE_CHARS`].
///
/// # Errors
/// [`RenderError`] as the tokenizer gives it; `Encode` when the blocking task failed.
pub(crate) async fn tokens_of(
    model: &Arc<ModelTokenizer>,
    body: &Map<String, Value>,
) -> Result<Vec<u32>, RenderError> {
    if prompt_chars(body) <= INLINE_CHARS {
        return model.tokens(body);
    }
    let (model, body) = (model.clone(), body.clone());
    tokio::task::spawn_blocking(move || model.tokens(&body))
        .await
        .unwrap_or_else(|e| Err(RenderError::Encode(format!("tokenizer task: {e}"))))
}

/// Per shape: `None` until a check found a difference, then what differed.
#[derive(Debug)]
pub(crate) struct LocalTokenizer {
    /// The loaded model tokenizer.
    pub(crate) model: Arc<ModelTokenizer>,
    mismatch: [Option<String>; 3],
    agreed: [u64; 3],
    /// Which requests are checked against which engine.
    pub(crate) sampler: Sampler,
    /// What it did, cumulative.
    pub(crate) counts: LocalCounts,
}

/// The router tokenizer's counts (`kv_index.router_tokenizer`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LocalCounts {
    /// Prompts tokenized here.
    pub(crate) tokenized: u64,
    /// Microseconds spent on them.
    pub(crate) micros: u64,
    /// Prompts not rendered here (asked of `/tokenize`).
    pub(crate) fallbacks: u64,
    /// Prompts checked against an engine's `/tokenize`.
    pub(crate) checked: u64,
}

/// What `/narwhal/state` shows of a shape: `unchecked`, `agree` or `mismatch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShapeView {
    /// The shape's name ([`Shape::as_str`]).
    pub(crate) shape: &'static str,
    /// `unchecked`, `agree`, `mismatch`.
    pub(crate) status: &'static str,
    /// What differed, for a mismatch.
    pub(crate) detail: Option<String>,
}

impl LocalTokenizer {
    /// Nothing checked yet, over `engines` engines.
    pub(crate) fn new(model: Arc<ModelTokenizer>, engines: usize) -> Self {
        LocalTokenizer {
            model,
            mismatch: [None, None, None],
            agreed: [0; 3],
            sampler: Sampler::new(engines),
            counts: LocalCounts::default(),
        }
    }

    /// Whether requests of `shape` are tokenized here (no difference found for it).
    pub(crate) fn usable(&self, shape: Shape) -> bool {
        self.mismatch[shape.slot()].is_none()
    }

    /// A check of `shape` came back: `None` when they agreed, else what differed. Returns
    /// whether this turned the shape to `mismatch` (the first difference; later ones keep it).
    pub(crate) fn checked(&mut self, shape: Shape, difference: Option<String>) -> bool {
        let s = shape.slot();
        match difference {
            None => {
                self.agreed[s] += 1;
                false
            }
            Some(d) => {
                let first = self.mismatch[s].is_none();
                if first {
                    self.mismatch[s] = Some(d);
                }
                first
            }
        }
    }

    /// Every shape's status, in [`Shape::ALL`] order.
    pub(crate) fn views(&self) -> Vec<ShapeView> {
        Shape::ALL
            .iter()
            .map(|shape| {
                let s = shape.slot();
                let status = match (&self.mismatch[s], self.agreed[s]) {
                    (Some(_), _) => "mismatch",
                    (None, 0) => "unchecked",
                    (None, _) => "agree",
                };
                ShapeView {
                    shape: shape.as_str(),
                    status,
                    detail: self.mismatch[s].clone(),
                }
            })
            .collect()
    }
}

/// The KV cache's side of the router's tokenizer: tokens computed here, and the sampled check.
impl KvCache {
    /// A request's tokens from the router's own tokenizer ([`local`]), when one is
    /// configured, the request's shape has not been found to differ from the engines, and
    /// the request renders here; `None` otherwise (the caller asks `/tokenize`; a request
    /// that does not render here is counted as a fallback). A sampled request is also sent
    /// to an engine's `/tokenize`, off the request path ([`KvCache::check_local`]).
    pub(super) async fn tokens_here(
        self: &Arc<Self>,
        fleet: &Fleet,
        body: &Map<String, Value>,
        known: Option<(&[u32], u64)>,
    ) -> Option<Vec<u32>> {
        let shape = Shape::of(body)?;
        let model = {
            let local = self.local()?;
            if !local.usable(shape) {
                return None;
            }
            local.model.clone()
        };
        let t0 = self.clock.now();
        let (r, earlier) = match known {
            Some((t, micros)) => (Ok(t.to_vec()), micros),
            None => (tokens_of(&model, body).await, 0),
        };
        let spent = self.clock.now().saturating_duration_since(t0)
            + std::time::Duration::from_micros(earlier);
        match r {
            Ok(tokens) => {
                if let Some(mut l) = self.local() {
                    l.counts.tokenized += 1;
                    l.counts.micros += spent.as_micros() as u64;
                }
                self.check_local(fleet, body, shape, &tokens);
                Some(tokens)
            }
            Err(err) => {
                if let Some(mut l) = self.local() {
                    l.counts.fallbacks += 1;
                }
                tracing::debug!(error = %err, shape = shape.as_str(), "kv score: the router's tokenizer does not render this request; asking an engine's /tokenize");
                None
            }
        }
    }

    /// The router tokenizer's sampled check: when its sampler picks a live engine for this
    /// request's shape (each engine once per shape, then one request in
    /// [`sample::SAMPLE_EVERY`]), the request's `/tokenize` body is sent to it off the request
    /// path and its tokens held against `tokens`. A difference sends the shape's requests to
    /// `/tokenize` from then on, warned once and shown in `/narwhal/state`
    /// (`kv_index.router_tokenizer`); a check that cannot be made is made by a later request.
    fn check_local(
        self: &Arc<Self>,
        fleet: &Fleet,
        body: &Map<String, Value>,
        shape: Shape,
        tokens: &[u32],
    ) {
        let live = || live_loads(fleet).into_iter().map(|(e, _)| e).collect();
        let Some(other) = self
            .local()
            .and_then(|mut l| l.sampler.pick(shape, usize::MAX, live))
        else {
            return;
        };
        let Ok(req) = tokenize_body(&self.cfg.model, body) else {
            return;
        };
        let me = self.clone();
        let ours = tokens.to_vec();
        tokio::spawn(async move {
            let theirs = match me.tokenize_on(other, &req).await {
                Ok(t) => t,
                Err(err) => {
                    tracing::debug!(error = %err, shape = shape.as_str(), "kv score: router tokenizer check not made; a later request makes it");
                    if let Some(mut l) = me.local() {
                        l.sampler.failed(shape, other);
                    }
                    return;
                }
            };
            let difference = (theirs != ours).then(|| {
                let first = ours.iter().zip(&theirs).take_while(|(a, b)| a == b).count();
                format!(
                    "the router and {} tokenize a {} request differently ({} and {} tokens, first difference at token {first})",
                    me.cfg.engines[other].iid,
                    shape.as_str(),
                    ours.len(),
                    theirs.len()
                )
            });
            let Some(mut l) = me.local() else { return };
            l.counts.checked += 1;
            if l.checked(shape, difference.clone()) {
                tracing::warn!(detail = %difference.unwrap_or_default(), shape = shape.as_str(), "kv score: the router's tokenizer differs from an engine's; this shape's requests are tokenized by the engines from now on");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> Arc<ModelTokenizer> {
        let dir = tempfile::tempdir().expect("tempdir");
        let vocab = serde_json::json!({"[UNK]": 0, "a": 1});
        let tok = serde_json::json!({"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}});
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).expect("write");
        Arc::new(ModelTokenizer::load(dir.path()).expect("load"))
    }

    #[test]
    fn a_difference_turns_only_its_shape_back_to_the_engines() {
        let mut l = LocalTokenizer::new(model(), 2);
        assert!(l.usable(Shape::ChatWithTools));
        assert_eq!(l.views()[0].status, "unchecked");
        assert!(!l.checked(Shape::Completion, None));
        assert!(l.checked(Shape::ChatWithTools, Some("e0: 10 and 12 tokens".into())));
        assert!(
            !l.checked(Shape::ChatWithTools, Some("again".into())),
            "reported once"
        );
        assert!(
            !l.checked(Shape::ChatWithTools, None),
            "an agreement does not undo it"
        );
        assert!(!l.usable(Shape::ChatWithTools));
        assert!(l.usable(Shape::Chat) && l.usable(Shape::Completion));
        let v = l.views();
        assert_eq!(
            v.iter().map(|s| s.status).collect::<Vec<_>>(),
            ["agree", "unchecked", "mismatch"]
        );
        assert_eq!(v[2].detail.as_deref(), Some("e0: 10 and 12 tokens"));
    }
}
