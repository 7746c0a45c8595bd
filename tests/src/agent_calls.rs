//! Calling a `narwhal-agent`'s API as a router, an operator or a stranger would (docs/agent.md;
//! identities in docs/security.md): HTTPS clients presenting a dev certificate, the fenced
//! attestation call, and the agent's fence as it keeps it on disk.
//!
//! ```text
//!   let router = client_as(&certs, "router");
//!   let (status, body) = agent.attest(&router, "p0", "n1", 9, "router-a").await;
//!   let (status, text) = get_text(&router, format!("{}/metrics", agent.url)).await;
//!   agent.fence_file()       {"epoch": 9, "holder": "router-a"}  (<state dir>/fence.json)
//! ```

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};

use crate::agent::AgentHandle;
use crate::certs::DevCerts;
use crate::http::http_client;

/// An HTTPS client presenting the dev certificate `name` and trusting the fleet CA (30 s
/// timeout).
///
/// # Panics
/// When the certificate files cannot be read.
pub fn client_as(certs: &DevCerts, name: &str) -> reqwest::Client {
    let tls = certs
        .tls_files(name)
        .client_config()
        .expect("client TLS config");
    http_client()
        .use_preconfigured_tls(tls)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// `GET url` as `client`: `(status, body text)`.
///
/// # Panics
/// When the request fails below HTTP.
pub async fn get_text(client: &reqwest::Client, url: String) -> (u16, String) {
    let r = client.get(&url).send().await.expect("GET");
    let status = r.status().as_u16();
    (status, r.text().await.expect("body"))
}

/// `POST url` with a JSON `body` as `client`: `(status, body)`, the body parsed as JSON or, when
/// it is not JSON, a JSON string of its text.
///
/// # Panics
/// When the request fails below HTTP.
pub async fn post_json(client: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = client.post(&url).json(&body).send().await.expect("POST");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

impl AgentHandle {
    /// `POST /v1/engines/<iid>/attestation` as `client` with the fence `{nonce, epoch,
    /// holder}`: `(status, body)`.
    pub async fn attest(
        &self,
        client: &reqwest::Client,
        iid: &str,
        nonce: &str,
        epoch: u64,
        holder: &str,
    ) -> (u16, Value) {
        let url = format!("{}/v1/engines/{iid}/attestation", self.url);
        let fence = json!({"nonce": nonce, "epoch": epoch, "holder": holder});
        post_json(client, url, fence).await
    }

    /// The agent's state directory (`agent-<id>-state` beside its config file).
    pub fn state_dir(&self) -> PathBuf {
        self.config
            .with_file_name(format!("agent-{}-state", self.agent_id))
    }

    /// The fence the agent keeps on disk (`<state dir>/fence.json`).
    ///
    /// # Panics
    /// When the file is missing or not JSON.
    pub fn fence_file(&self) -> Value {
        let path = self.state_dir().join("fence.json");
        serde_json::from_slice(&std::fs::read(&path).expect("fence.json")).expect("fence JSON")
    }
}
