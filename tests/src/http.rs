//! HTTP for tests: one client type, replies read whole, and the document shapes tests read
//! (JSON bodies, SSE `data:` frames, Prometheus samples).
//!
//! Every helper here panics with the URL and what went wrong instead of returning transport
//! errors: a test that cannot reach a process it started has failed, and the message says
//! where. [`Http::try_get`] is the exception, for sampling processes that may be stopped.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

use crate::certs::DevCerts;

/// A `reqwest` client builder for loopback traffic: no proxies (CI machines may set
/// `HTTP_PROXY`), and rustls's ring provider installed first (our reqwest build carries no
/// default provider).
pub fn http_client() -> reqwest::ClientBuilder {
    // Installing twice is harmless: the second call returns Err, which is ignored.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().no_proxy()
}

/// A test HTTP client (cheap to clone: one connection pool).
#[derive(Debug, Clone)]
pub struct Http {
    client: reqwest::Client,
}

/// One reply, read to its end.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status code (compares with a `u16` too: `reply.status == 200`).
    pub status: StatusCode,
    /// Response headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
    /// `METHOD URL`, for failure messages.
    pub what: String,
}

impl Http {
    /// A plain client whose requests give up after `timeout` (connect and whole exchange).
    pub fn new(timeout: Duration) -> Http {
        Http::from_builder(http_client(), timeout)
    }

    /// A client that trusts the fleet CA of `certs` and presents the certificate `name`
    /// (e.g. `operator`): accepted by mutual-TLS control listeners and by the agents. Plain
    /// `http://` URLs ignore the TLS settings.
    ///
    /// # Panics
    /// When the certificate files cannot be loaded.
    pub fn with_identity(certs: &DevCerts, name: &str, timeout: Duration) -> Http {
        let tls = certs
            .tls_files(name)
            .client_config()
            .unwrap_or_else(|e| panic!("TLS client identity {name}: {e}"));
        Http::from_builder(http_client().use_preconfigured_tls(tls), timeout)
    }

    fn from_builder(builder: reqwest::ClientBuilder, timeout: Duration) -> Http {
        let client = builder
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .expect("HTTP client builds");
        Http { client }
    }

    /// The underlying client, for requests the helpers do not cover (streams, odd bodies).
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// `GET url`.
    pub async fn get(&self, url: impl AsRef<str>) -> Reply {
        let url = url.as_ref();
        self.send(self.client.get(url), format!("GET {url}")).await
    }

    /// `GET url`, `None` when the request fails (refused, timed out): for sampling.
    pub async fn try_get(&self, url: impl AsRef<str>) -> Option<Reply> {
        let url = url.as_ref();
        Reply::read(
            self.client.get(url).send().await.ok()?,
            format!("GET {url}"),
        )
        .await
        .ok()
    }

    /// `POST url` with a JSON body.
    pub async fn post(&self, url: impl AsRef<str>, body: &Value) -> Reply {
        let url = url.as_ref();
        self.send(self.client.post(url).json(body), format!("POST {url}"))
            .await
    }

    /// `POST url` with a JSON body, keeping whatever body arrived before it ended or broke
    /// off (a stream cut mid-way is not an error here).
    pub async fn post_partial(&self, url: impl AsRef<str>, body: &Value) -> Reply {
        let url = url.as_ref();
        let what = format!("POST {url}");
        let mut resp = self
            .client
            .post(url)
            .json(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (status, headers) = (resp.status(), resp.headers().clone());
        let mut bytes = Vec::new();
        while let Ok(Some(c)) = resp.chunk().await {
            bytes.extend_from_slice(&c);
        }
        Reply {
            status,
            headers,
            body: bytes.into(),
            what,
        }
    }

    /// `POST url` with `body` sent as is, labelled `content-type: application/json`.
    pub async fn post_raw(&self, url: impl AsRef<str>, body: &str) -> Reply {
        let url = url.as_ref();
        let req = self
            .client
            .post(url)
            .header("content-type", "application/json")
            .body(body.to_string());
        self.send(req, format!("POST {url}")).await
    }

    /// `DELETE url`.
    pub async fn delete(&self, url: impl AsRef<str>) -> Reply {
        let url = url.as_ref();
        self.send(self.client.delete(url), format!("DELETE {url}"))
            .await
    }

    async fn send(&self, req: reqwest::RequestBuilder, what: String) -> Reply {
        let resp = req.send().await.unwrap_or_else(|e| panic!("{what}: {e}"));
        Reply::read(resp, what.clone())
            .await
            .unwrap_or_else(|e| panic!("{what}: reading the body: {e}"))
    }
}

impl Reply {
    /// Reads `resp` to its end.
    ///
    /// # Errors
    /// The transport error that cut the body.
    pub async fn read(resp: reqwest::Response, what: String) -> reqwest::Result<Reply> {
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.bytes().await?;
        Ok(Reply {
            status,
            headers,
            body,
            what,
        })
    }

    /// The body as JSON.
    ///
    /// # Panics
    /// When it is not JSON (the message names the request, the status and the body).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{}: {} answered a body that is not JSON ({e}): {}",
                self.what,
                self.status,
                self.text()
            )
        })
    }

    /// The body as the typed document `T`.
    ///
    /// # Panics
    /// When it is not a `T` (the message names the request, the status, the error and the
    /// body).
    pub fn json_as<T: serde::de::DeserializeOwned>(&self) -> T {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{}: {} answered a body that is not the document expected ({e}): {}",
                self.what,
                self.status,
                self.text()
            )
        })
    }

    /// The body as JSON, `Value::Null` when it is not JSON.
    pub fn json_or_null(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// `(status, body as JSON or Null)`, the shape most assertions want.
    pub fn status_json(&self) -> (u16, Value) {
        (self.status.as_u16(), self.json_or_null())
    }

    /// The body as (lossy) UTF-8.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The SSE `data:` payloads of the body ([`sse_data`]).
    pub fn sse(&self) -> Vec<String> {
        sse_data(&self.text())
    }

    /// Header `name` as text (`""` when absent or not text).
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    }
}

/// The `data:` payloads of an SSE body, in order: events are split at blank lines, and the
/// `data:` prefix and the white space around each payload are removed (a `data: [DONE]`
/// payload is `[DONE]`).
pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|f| f.trim().strip_prefix("data:").map(|d| d.trim().to_string()))
        .collect()
}

/// The generated text of streamed completion or chat frames: every `choices[0].text` and
/// `choices[0].delta.content` in order; `[DONE]` is skipped.
///
/// # Panics
/// When another frame is not JSON.
pub fn sse_text(frames: &[String]) -> String {
    let mut out = String::new();
    for f in frames.iter().filter(|f| f.as_str() != "[DONE]") {
        let v: Value =
            serde_json::from_str(f).unwrap_or_else(|e| panic!("SSE frame is not JSON ({e}): {f}"));
        let c = &v["choices"][0];
        for t in [&c["text"], &c["delta"]["content"]] {
            out.push_str(t.as_str().unwrap_or_default());
        }
    }
    out
}

/// An OpenAI request for model `tiny-sim`: `(path, body)` of a chat completion
/// (`/v1/chat/completions`, one user message) or a completion (`/v1/completions`), streamed
/// or not, of at most `max_tokens` tokens.
pub fn openai_request(
    chat: bool,
    stream: bool,
    prompt: &str,
    max_tokens: u32,
) -> (&'static str, Value) {
    if chat {
        (
            "/v1/chat/completions",
            json!({"model": "tiny-sim", "stream": stream, "max_tokens": max_tokens,
                   "messages": [{"role": "user", "content": prompt}]}),
        )
    } else {
        (
            "/v1/completions",
            json!({"model": "tiny-sim", "stream": stream, "max_tokens": max_tokens,
                   "prompt": prompt}),
        )
    }
}

/// The generated text of a non-streaming completion (`choices[0].text`) or chat answer
/// (`choices[0].message.content`); `""` when neither is there.
pub fn answer_text(v: &Value) -> String {
    let c = &v["choices"][0];
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// The value of a Prometheus text-format sample: the first line whose metric name is exactly
/// `name` (followed by `{` or a space; `# HELP`/`# TYPE` lines never match) and that contains
/// every one of `labels` (e.g. `iid="d0"`). `None` when there is no such line.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .filter(|l| labels.iter().all(|p| l.contains(p)))
        .find_map(|l| l.rsplit(' ').next().and_then(|v| v.parse().ok()))
}

/// A count in a JSON document (`stats["kv"]["issued"]`).
///
/// # Panics
/// When `v` is not a non-negative integer.
pub fn count(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("expected a count, got {v}"))
}

/// A list of strings in a JSON document (`doc["engines"]["d0"]["checks"]`).
///
/// # Panics
/// When `v` is not a list (members that are not strings become `""`).
pub fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected a list, got {v}"))
        .iter()
        .map(|s| s.as_str().unwrap_or_default().to_string())
        .collect()
}

/// A completion answer or stream chunk as the router sends it, the fields tests read; `None`:
/// absent or `null`. Engines' answers are open documents: this reads what the tests check.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(default)]
pub struct Answer {
    /// `text_completion`, `chat.completion.chunk`, ...
    pub object: Option<String>,
    /// The choices.
    pub choices: Option<Vec<AnswerChoice>>,
    /// The usage.
    pub usage: Option<Usage>,
    /// The answer's id.
    pub id: Option<String>,
    /// The model named.
    pub model: Option<String>,
    /// vLLM's `kv_transfer_params` (a prefill's descriptor; an open document).
    pub kv_transfer_params: Option<Value>,
}

/// One of an [`Answer`]'s choices.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(default)]
pub struct AnswerChoice {
    /// Its index.
    pub index: Option<u64>,
    /// A completion's text.
    pub text: Option<String>,
    /// Why it ended.
    pub finish_reason: Option<String>,
    /// A chat answer's message.
    pub message: Option<AnswerMessage>,
    /// A chat chunk's delta.
    pub delta: Option<AnswerMessage>,
    /// The generated token ids (vLLM's `return_token_ids`).
    pub token_ids: Option<Vec<u64>>,
    /// The prompt's token ids (vLLM's `return_token_ids`).
    pub prompt_token_ids: Option<Vec<u64>>,
}

/// A chat choice's `message` or a chat chunk's `delta`.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(default)]
pub struct AnswerMessage {
    /// `assistant`, ...
    pub role: Option<String>,
    /// The text.
    pub content: Option<String>,
    /// Tool calls (an open document).
    pub tool_calls: Option<Value>,
}

impl Answer {
    /// Choice `k`, if there is one.
    pub fn choice(&self, k: usize) -> Option<&AnswerChoice> {
        self.choices.as_ref().and_then(|c| c.get(k))
    }

    /// The number of choices (`None` without a `choices` list).
    pub fn choice_count(&self) -> Option<usize> {
        self.choices.as_ref().map(Vec::len)
    }

    /// The usage, default when absent.
    pub fn usage(&self) -> Usage {
        self.usage.unwrap_or_default()
    }
}

/// OpenAI's `usage` of a completion answer or chunk, as tests read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: Option<u64>,
    /// Generated tokens.
    pub completion_tokens: Option<u64>,
    /// Their sum.
    pub total_tokens: Option<u64>,
    /// The router estimated the counts (the engine gave none).
    pub estimated: Option<bool>,
    /// vLLM's `prompt_tokens_details`, when the engine sent it.
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details` (OpenAI's; vLLM sends it with `--enable-prompt-tokens-details`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(default)]
pub struct PromptTokensDetails {
    /// Prompt tokens read from the prefix cache.
    pub cached_tokens: Option<u64>,
}

/// The `usage` of answer `v` (an OpenAI answer or chunk, or an SDK driver result), typed; every
/// field `None` when it has none, or when any of its counts is not a whole number.
pub fn usage_of(v: &Value) -> Usage {
    v.get("usage")
        .and_then(|u| serde_json::from_value(u.clone()).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_matches_the_exact_name_and_every_label() {
        let page = "# HELP x\nnarwhal_gap_seconds 2.5\nnarwhal_gap_seconds_x 9\n\
                    narwhal_ej_total{iid=\"d0\",cause=\"stream\"} 3\n";
        assert_eq!(metric(page, "narwhal_gap_seconds", &[]), Some(2.5));
        assert_eq!(metric(page, "narwhal_gap", &[]), None);
        assert_eq!(
            metric(
                page,
                "narwhal_ej_total",
                &["iid=\"d0\"", "cause=\"stream\""]
            ),
            Some(3.0)
        );
        assert_eq!(metric(page, "narwhal_ej_total", &["iid=\"d1\""]), None);
    }

    #[test]
    fn sse_frames_and_text() {
        let body = "data: {\"choices\":[{\"text\":\" a\"}]}\n\n\
                    data: {\"choices\":[{\"delta\":{\"content\":\" b\"}}]}\n\ndata: [DONE]\n\n";
        let frames = sse_data(body);
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[2], "[DONE]");
        assert_eq!(sse_text(&frames), " a b");
    }
}
