//! Types and mechanisms shared by the Narwhal router (`narwhal-serve`), the engine agent
//! (`narwhal-agent`), `narwhalctl` and the test kit: clocks, the versioned schemas (handoff,
//! the control-plane documents, agent protocol, attestations), canonical JSON, Ed25519
//! signing, the agent client, rustls configuration builders and vLLM's KV event encoding
//! (`kv_events`: the router decodes the engines' events, the test kit's simulator encodes them).
//!
//! Everything here is pure or near-pure so both sides of a protocol use one implementation
//! (architecture.md section 2).

mod clock;

pub use clock::{Clock, ClockError, ManualClock, SystemClock};

// Agent protocol: canonical JSON, keys, signed answers, verifier, mTLS, client.
pub mod agent_client;
pub mod agent_protocol;
pub mod atomic;
pub mod attestation;
mod canonical;
pub mod check_request;
pub mod documents;
pub mod handoff;
mod identity;
pub mod kv_blocks;
pub mod kv_events;
pub mod kv_stream;
pub mod net;
mod signing;
pub mod tls;

pub use agent_client::{
    AgentClient, AgentClientError, AgentEndpoint, AgentTimeouts, Fence, Verified,
};
pub use agent_protocol::TransferVerdict;
pub use atomic::{AtomicWriteError, write_atomic};
pub use attestation::{
    AttestationPayload, EngineFacts, Expected, GenerationPayload, Header, KvConsumePayload,
    KvProducePayload, LegResult, ProbePayload, SignedPayload, TransferEvidence, Verifier,
    VerifyError,
};
pub use canonical::{canonical_json, sha256_digest};
pub use identity::{PodBinding, ProcessIdentity};
pub use signing::{KeyError, PublicKey, SignedDocument, SigningKey};
pub use tls::{TlsError, TlsFiles};
