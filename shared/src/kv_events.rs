//! vLLM's KV cache events on the wire: the msgpack encoding of `KVEventBatch` and its events
//! (vLLM 0.32.0, `vllm/distributed/kv_events.py`), and the ZMQ frames its `ZmqEventPublisher`
//! sends. Pure (no sockets): the router decodes the engines' batches with [`decode_batch`] (its
//! KV index, docs/design/kv-aware-placement.md), the engine simulator publishes with
//! [`encode_batch`], and `tests/tests/e2e/kv_events_e2e.rs` checks the bytes against vLLM's own
//! publisher (docs/engine-simulator.md, "KV events").
//!
//! ```text
//! PUB frames       [topic (UTF-8), seq (u64, 8 bytes big-endian, 0 first per process), payload]
//! payload          msgpack array  [ts (float64, Unix seconds), [event...], data_parallel_rank]
//! event            msgpack map    {"type": "BlockStored", field: value, ...}  (tagged struct;
//!                                 fields in declaration order; a field equal to its default is
//!                                 left out, one without a default is always there, even nil)
//! replay request   ROUTER receives [identity, "", start seq (8 bytes big-endian)]
//! replay answer    [identity, "", topic, seq, payload] per buffered batch with seq >= start,
//!                  then [identity, "", "", REPLAY_END, ""]
//! ```
//!
//! Block hashes are msgpack unsigned ints: vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`
//! publishes the low 64 bits of each block hash as an int.

use rmp::Marker;

/// The sequence number that ends a replay: `-1` as 8 bytes big-endian (all `0xff`).
pub const REPLAY_END: [u8; 8] = (-1i64).to_be_bytes();

/// vLLM's `MEDIUM_GPU`: where a block lives, in `BlockStored.medium` / `BlockRemoved.medium`.
pub const MEDIUM_GPU: &str = "GPU";

/// One KV cache event (vLLM's `BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
///
/// Fields vLLM declares but the simulator never sets (`kv_cache_spec_sliding_window`,
/// `locality`, `ownership`) are not modelled: they are left
/// out on encode (their default, `None`) and skipped on decode.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Full blocks entered the prefix cache (one event per `cache_full_blocks` call).
    BlockStored {
        /// One hash per stored block, in prompt order (low 64 bits of vLLM's hash).
        block_hashes: Vec<u64>,
        /// Hash of the block before the first stored one; `None` when the first stored block
        /// is the prompt's first block.
        parent_block_hash: Option<u64>,
        /// The token ids of all stored blocks, concatenated (`block_hashes.len() × block_size`).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// LoRA adapter id (deprecated in vLLM; `None` without LoRA).
        lora_id: Option<i64>,
        /// Storage medium, `Some("GPU")` for vLLM's GPU block pool.
        medium: Option<String>,
        /// LoRA adapter name (`None` without LoRA).
        lora_name: Option<String>,
        /// Extra hash keys, one entry per block (`None` entries for plain text prompts);
        /// `None` leaves the field out. vLLM publishes them untagged
        /// (`kv_cache_utils.to_event_extra_keys`), see [`ExtraKey`].
        extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
        /// KV cache group index (`Some(0)` for a one-group model); `None` leaves it out.
        group_idx: Option<u32>,
        /// The attention kind of that group (vLLM's `KVCacheSpecKind` value: `full_attention`,
        /// `mla_attention`, `sliding_window`, `mamba`, ...; `KVCacheManager.take_events`
        /// annotates every store with it); `None` leaves it out.
        kv_cache_spec_kind: Option<String>,
        /// The session that triggered the store; `None` leaves it out.
        session_id: Option<String>,
        /// SGLang's `cache_salt`: the salt of the request that stored the blocks, on every
        /// event of a salted prefix (SGLang 0.5 `BlockStored.cache_salt`; its block hashes are
        /// namespaced by it). vLLM has no such field (its salt is in `extra_keys`): vLLM's
        /// encoding ([`encode_batch`]) leaves it out.
        cache_salt: Option<String>,
    },
    /// Blocks left the prefix cache (vLLM sends one event per evicted block).
    BlockRemoved {
        /// Hashes of the removed blocks.
        block_hashes: Vec<u64>,
        /// Storage medium (`Some("GPU")`).
        medium: Option<String>,
        /// KV cache group index; `None` leaves it out.
        group_idx: Option<u32>,
    },
    /// The whole prefix cache was reset (`POST /reset_prefix_cache`).
    AllBlocksCleared,
    /// An event of a type this module does not know (a newer engine's), with its type name:
    /// decoded so the rest of its batch still counts; a consumer skips it and counts it, never
    /// resets on it.
    Other {
        /// The event's `type` tag.
        kind: String,
    },
}

/// One published batch (vLLM's `KVEventBatch`).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// When the batch was made, Unix seconds (float64 on the wire).
    pub ts: f64,
    /// The events, in the order they happened.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank; vLLM's publisher fills in its rank (0) when it is `None`, so
    /// published batches always carry it.
    pub data_parallel_rank: Option<i64>,
}

/// A payload that is not a `KVEventBatch` this module understands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed KV event batch at byte {at}: {what}")]
pub struct DecodeError {
    /// Offset into the payload.
    pub at: usize,
    /// What was expected.
    pub what: String,
}

/// Encodes `batch` exactly as msgspec's encoder does for vLLM's classes.
pub fn encode_batch(batch: &KvEventBatch) -> Vec<u8> {
    let mut w = Vec::with_capacity(64 + batch.events.len() * 64);
    let n = if batch.data_parallel_rank.is_some() {
        3
    } else {
        2
    };
    array(&mut w, n);
    let _ = rmp::encode::write_f64(&mut w, batch.ts);
    array(&mut w, batch.events.len());
    for e in &batch.events {
        encode_event(&mut w, e);
    }
    if let Some(r) = batch.data_parallel_rank {
        int(&mut w, r);
    }
    w
}

/// Encodes `batch` exactly as msgspec's encoder does for SGLang 0.5's classes
/// (`sglang/srt/disaggregation/kv_events.py`, checked against SGLang's own publisher by
/// `tests/tests/e2e/kv_events_e2e.rs`). Where SGLang differs from vLLM ([`encode_batch`]):
/// block hashes are signed int64 (SGLang's `hash_str_to_int64`: a hash here is written as its
/// two's complement `i64`); `medium`, `cache_salt`, `session_id` and `lora_name` are written
/// only when set (defaults, which msgspec omits), in that order, after `lora_id`; there are
/// no `extra_keys` or `group_idx` (left out whatever the event holds); the batch is always
/// three items, `[ts, events, attn_dp_rank]` (not `omit_defaults`: an unset rank is nil).
pub fn encode_sglang_batch(batch: &KvEventBatch) -> Vec<u8> {
    let mut w = Vec::with_capacity(64 + batch.events.len() * 64);
    array(&mut w, 3);
    let _ = rmp::encode::write_f64(&mut w, batch.ts);
    array(&mut w, batch.events.len());
    let signed = |w: &mut Vec<u8>, hs: &[u64]| {
        array(w, hs.len());
        for h in hs {
            int(w, *h as i64);
        }
    };
    for e in &batch.events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                session_id,
                cache_salt,
                ..
            } => {
                let optional = [
                    ("medium", medium),
                    ("cache_salt", cache_salt),
                    ("session_id", session_id),
                    ("lora_name", lora_name),
                ];
                let n = 6 + optional.iter().filter(|(_, v)| v.is_some()).count();
                let _ = rmp::encode::write_map_len(&mut w, n as u32);
                str(&mut w, "type");
                str(&mut w, "BlockStored");
                str(&mut w, "block_hashes");
                signed(&mut w, block_hashes);
                str(&mut w, "parent_block_hash");
                match parent_block_hash {
                    Some(p) => int(&mut w, *p as i64),
                    None => nil(&mut w),
                }
                str(&mut w, "token_ids");
                array(&mut w, token_ids.len());
                for t in token_ids {
                    uint(&mut w, u64::from(*t));
                }
                str(&mut w, "block_size");
                uint(&mut w, u64::from(*block_size));
                str(&mut w, "lora_id");
                match lora_id {
                    Some(v) => int(&mut w, *v),
                    None => nil(&mut w),
                }
                for (k, v) in optional {
                    if let Some(v) = v {
                        str(&mut w, k);
                        str(&mut w, v);
                    }
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => {
                let _ = rmp::encode::write_map_len(&mut w, 2 + u32::from(medium.is_some()));
                str(&mut w, "type");
                str(&mut w, "BlockRemoved");
                str(&mut w, "block_hashes");
                signed(&mut w, block_hashes);
                if let Some(m) = medium {
                    str(&mut w, "medium");
                    str(&mut w, m);
                }
            }
            other => encode_event(&mut w, other),
        }
    }
    match batch.data_parallel_rank {
        Some(r) => int(&mut w, r),
        None => nil(&mut w),
    }
    w
}

/// The three PUB frames of one batch: `[topic, seq (8 bytes big-endian), payload]`.
pub fn pub_frames(topic: &str, seq: u64, payload: &[u8]) -> [Vec<u8>; 3] {
    [
        topic.as_bytes().to_vec(),
        seq.to_be_bytes().to_vec(),
        payload.to_vec(),
    ]
}

fn array(w: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_array_len(w, n as u32);
}

fn int(w: &mut Vec<u8>, v: i64) {
    let _ = rmp::encode::write_sint(w, v);
}

fn uint(w: &mut Vec<u8>, v: u64) {
    let _ = rmp::encode::write_uint(w, v);
}

fn str(w: &mut Vec<u8>, s: &str) {
    let _ = rmp::encode::write_str(w, s);
}

fn nil(w: &mut Vec<u8>) {
    let _ = rmp::encode::write_nil(w);
}

fn opt_u64(w: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => uint(w, v),
        None => nil(w),
    }
}

fn opt_str(w: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => str(w, s),
        None => nil(w),
    }
}

fn hashes(w: &mut Vec<u8>, hs: &[u64]) {
    array(w, hs.len());
    for h in hs {
        uint(w, *h);
    }
}

fn encode_event(w: &mut Vec<u8>, e: &KvEvent) {
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
            kv_cache_spec_kind,
            session_id,
            cache_salt: _,
        } => {
            let n = 8
                + usize::from(extra_keys.is_some())
                + usize::from(group_idx.is_some())
                + usize::from(kv_cache_spec_kind.is_some())
                + usize::from(session_id.is_some());
            let _ = rmp::encode::write_map_len(w, n as u32);
            str(w, "type");
            str(w, "BlockStored");
            str(w, "block_hashes");
            hashes(w, block_hashes);
            str(w, "parent_block_hash");
            opt_u64(w, *parent_block_hash);
            str(w, "token_ids");
            array(w, token_ids.len());
            for t in token_ids {
                uint(w, u64::from(*t));
            }
            str(w, "block_size");
            uint(w, u64::from(*block_size));
            str(w, "lora_id");
            match lora_id {
                Some(v) => int(w, *v),
                None => nil(w),
            }
            str(w, "medium");
            opt_str(w, medium.as_deref());
            str(w, "lora_name");
            opt_str(w, lora_name.as_deref());
            if let Some(keys) = extra_keys {
                str(w, "extra_keys");
                array(w, keys.len());
                for k in keys {
                    match k {
                        None => nil(w),
                        Some(parts) => {
                            array(w, parts.len());
                            for p in parts {
                                encode_extra_key(w, p);
                            }
                        }
                    }
                }
            }
            if let Some(g) = group_idx {
                str(w, "group_idx");
                uint(w, u64::from(*g));
            }
            if let Some(k) = kv_cache_spec_kind {
                str(w, "kv_cache_spec_kind");
                str(w, k);
            }
            if let Some(s) = session_id {
                str(w, "session_id");
                str(w, s);
            }
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => {
            let n = 3 + usize::from(group_idx.is_some());
            let _ = rmp::encode::write_map_len(w, n as u32);
            str(w, "type");
            str(w, "BlockRemoved");
            str(w, "block_hashes");
            hashes(w, block_hashes);
            str(w, "medium");
            opt_str(w, medium.as_deref());
            if let Some(g) = group_idx {
                str(w, "group_idx");
                uint(w, u64::from(*g));
            }
        }
        KvEvent::AllBlocksCleared => {
            let _ = rmp::encode::write_map_len(w, 1);
            str(w, "type");
            str(w, "AllBlocksCleared");
        }
        KvEvent::Other { kind } => {
            let _ = rmp::encode::write_map_len(w, 1);
            str(w, "type");
            str(w, kind);
        }
    }
}

/// One untagged entry of a block's `extra_keys`, as vLLM 0.32 publishes it
/// (`vllm/v1/core/kv_cache_utils.py`: `generate_block_hash_extra_keys` builds, per block and in
/// this order, the LoRA adapter's name (every block of a LoRA request), `(mm_identifier,
/// offset)` for each multimodal item the block holds, the `cache_salt` (the prompt's first
/// block only) and the digest of the block's prompt embeddings; `to_event_extra_keys` drops
/// the tags). A string is thus the adapter's name when the event's `lora_name` is set and it
/// comes first, and otherwise the salt.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// A string: the LoRA adapter's name or the `cache_salt`.
    Text(String),
    /// A multimodal item in the block: its identifier (vLLM's content hash of the item, or the
    /// request's `multi_modal_uuids` entry) and its offset from the block's first token
    /// (negative when it began in an earlier block).
    Media {
        /// The item's identifier.
        identifier: String,
        /// Its first token's position relative to the block's first token.
        offset: i64,
    },
    /// A digest (bytes): the SHA-256 of the block's prompt embeddings.
    Digest(Vec<u8>),
    /// Any other shape (a newer engine's key), kept as its msgpack encoding (canonical: the
    /// smallest int and string forms, floats as float64) so that it still tells blocks apart
    /// and re-encodes as it came; never produced by a request.
    Other(Vec<u8>),
}

fn encode_extra_key(w: &mut Vec<u8>, k: &ExtraKey) {
    match k {
        ExtraKey::Text(s) => str(w, s),
        ExtraKey::Media { identifier, offset } => {
            array(w, 2);
            str(w, identifier);
            int(w, *offset);
        }
        ExtraKey::Digest(b) => {
            let _ = rmp::encode::write_bin(w, b);
        }
        ExtraKey::Other(raw) => w.extend_from_slice(raw),
    }
}

fn decode_extra_key(v: &Val) -> ExtraKey {
    match v {
        Val::Str(s) => ExtraKey::Text(s.clone()),
        Val::Array(parts) => match parts.as_slice() {
            [Val::Str(identifier), Val::Int(offset)] if i64::try_from(*offset).is_ok() => {
                ExtraKey::Media {
                    identifier: identifier.clone(),
                    offset: *offset as i64,
                }
            }
            _ => ExtraKey::Other(encode_val(v)),
        },
        Val::Bin(b) => ExtraKey::Digest(b.clone()),
        other => ExtraKey::Other(encode_val(other)),
    }
}

/// `v` in canonical msgpack (see [`ExtraKey::Other`]).
fn encode_val(v: &Val) -> Vec<u8> {
    fn put(w: &mut Vec<u8>, v: &Val) {
        match v {
            Val::Nil => nil(w),
            Val::Bool(b) => {
                let _ = rmp::encode::write_bool(w, *b);
            }
            Val::Int(i) => match (u64::try_from(*i), i64::try_from(*i)) {
                (Ok(u), _) => uint(w, u),
                (_, Ok(s)) => int(w, s),
                // Never decoded: msgpack ints fit u64 or i64.
                _ => nil(w),
            },
            Val::Float(f) => {
                let _ = rmp::encode::write_f64(w, *f);
            }
            Val::Str(s) => str(w, s),
            Val::Bin(b) => {
                let _ = rmp::encode::write_bin(w, b);
            }
            Val::Array(items) => {
                array(w, items.len());
                for x in items {
                    put(w, x);
                }
            }
            Val::Map(pairs) => {
                let _ = rmp::encode::write_map_len(w, pairs.len() as u32);
                for (k, x) in pairs {
                    put(w, k);
                    put(w, x);
                }
            }
        }
    }
    let mut w = Vec::new();
    put(&mut w, v);
    w
}

/// A msgpack value, as far as KV events need one.
#[derive(Debug, Clone, PartialEq)]
enum Val {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Val>),
    Map(Vec<(Val, Val)>),
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    /// Arrays and maps open around the value being read.
    depth: usize,
}

/// Deepest nesting of arrays and maps decoded. A `KVEventBatch` nests four deep (batch,
/// events, event, `extra_keys` entries); without a bound, a payload of nested arrays
/// overflowed the decoding thread's stack and aborted the router.
const MAX_DEPTH: usize = 32;

impl Reader<'_> {
    fn err(&self, what: impl Into<String>) -> DecodeError {
        DecodeError {
            at: self.at,
            what: what.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| self.err(format!("{n} more bytes")))?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |a, b| (a << 8) | u64::from(*b)))
    }

    fn len_of(&mut self, n: usize) -> Result<usize, DecodeError> {
        Ok(self.be(n)? as usize)
    }

    fn value(&mut self) -> Result<Val, DecodeError> {
        if self.depth >= MAX_DEPTH {
            return Err(self.err(format!("nesting at most {MAX_DEPTH} deep")));
        }
        self.depth += 1;
        let v = self.one_value();
        self.depth -= 1;
        v
    }

    fn one_value(&mut self) -> Result<Val, DecodeError> {
        let b = self.take(1)?[0];
        let items = |r: &mut Self, n: usize| -> Result<Vec<Val>, DecodeError> {
            (0..n).map(|_| r.value()).collect()
        };
        let pairs = |r: &mut Self, n: usize| -> Result<Vec<(Val, Val)>, DecodeError> {
            (0..n).map(|_| Ok((r.value()?, r.value()?))).collect()
        };
        let text = |r: &mut Self, n: usize| -> Result<Val, DecodeError> {
            let s = r.take(n)?.to_vec();
            String::from_utf8(s)
                .map(Val::Str)
                .map_err(|_| r.err("UTF-8 string"))
        };
        Ok(match Marker::from_u8(b) {
            Marker::FixPos(v) => Val::Int(i128::from(v)),
            Marker::FixNeg(v) => Val::Int(i128::from(v)),
            Marker::Null => Val::Nil,
            Marker::True => Val::Bool(true),
            Marker::False => Val::Bool(false),
            Marker::U8 => Val::Int(i128::from(self.be(1)?)),
            Marker::U16 => Val::Int(i128::from(self.be(2)?)),
            Marker::U32 => Val::Int(i128::from(self.be(4)?)),
            Marker::U64 => Val::Int(i128::from(self.be(8)?)),
            Marker::I8 => Val::Int(i128::from(self.be(1)? as u8 as i8)),
            Marker::I16 => Val::Int(i128::from(self.be(2)? as u16 as i16)),
            Marker::I32 => Val::Int(i128::from(self.be(4)? as u32 as i32)),
            Marker::I64 => Val::Int(i128::from(self.be(8)? as i64)),
            Marker::F32 => Val::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            Marker::F64 => Val::Float(f64::from_bits(self.be(8)?)),
            Marker::FixStr(n) => text(self, usize::from(n))?,
            Marker::Str8 => {
                let n = self.len_of(1)?;
                text(self, n)?
            }
            Marker::Str16 => {
                let n = self.len_of(2)?;
                text(self, n)?
            }
            Marker::Str32 => {
                let n = self.len_of(4)?;
                text(self, n)?
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let w = match Marker::from_u8(b) {
                    Marker::Bin8 => 1,
                    Marker::Bin16 => 2,
                    _ => 4,
                };
                let n = self.len_of(w)?;
                Val::Bin(self.take(n)?.to_vec())
            }
            Marker::FixArray(n) => Val::Array(items(self, usize::from(n))?),
            Marker::Array16 => {
                let n = self.len_of(2)?;
                Val::Array(items(self, n)?)
            }
            Marker::Array32 => {
                let n = self.len_of(4)?;
                Val::Array(items(self, n)?)
            }
            Marker::FixMap(n) => Val::Map(pairs(self, usize::from(n))?),
            Marker::Map16 => {
                let n = self.len_of(2)?;
                Val::Map(pairs(self, n)?)
            }
            Marker::Map32 => {
                let n = self.len_of(4)?;
                Val::Map(pairs(self, n)?)
            }
            m => return Err(self.err(format!("a supported msgpack type, not {m:?}"))),
        })
    }
}

fn bad(what: &str) -> DecodeError {
    DecodeError {
        at: 0,
        what: what.to_string(),
    }
}

fn as_u64(v: &Val, what: &str) -> Result<u64, DecodeError> {
    match v {
        Val::Int(i) => u64::try_from(*i).map_err(|_| bad(what)),
        _ => Err(bad(what)),
    }
}

fn as_opt_u64(v: &Val, what: &str) -> Result<Option<u64>, DecodeError> {
    match v {
        Val::Nil => Ok(None),
        v => as_u64(v, what).map(Some),
    }
}

fn as_opt_str(v: &Val, what: &str) -> Result<Option<String>, DecodeError> {
    match v {
        Val::Nil => Ok(None),
        Val::Str(s) => Ok(Some(s.clone())),
        _ => Err(bad(what)),
    }
}

fn as_list<'v>(v: &'v Val, what: &str) -> Result<&'v [Val], DecodeError> {
    match v {
        Val::Array(a) => Ok(a),
        _ => Err(bad(what)),
    }
}

fn u64s(v: &Val, what: &str) -> Result<Vec<u64>, DecodeError> {
    as_list(v, what)?.iter().map(|x| as_u64(x, what)).collect()
}

/// A block hash as the engines publish it, as the 64 bits a consumer keys by: vLLM's
/// unsigned int (the low 64 bits of its hash), SGLang's signed int64 (`hash_str_to_int64`:
/// negative for half of all blocks; its two's complement bits here), or bytes (vLLM with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: the last 8 bytes, big-endian). Hashes are only
/// compared with hashes of the same stream, so any one-to-one reading serves.
fn as_hash(v: &Val, what: &str) -> Result<u64, DecodeError> {
    match v {
        Val::Int(i) => u64::try_from(*i)
            .ok()
            .or_else(|| i64::try_from(*i).ok().map(|s| s as u64))
            .ok_or_else(|| bad(what)),
        Val::Bin(b) if !b.is_empty() => Ok(b[b.len().saturating_sub(8)..]
            .iter()
            .fold(0u64, |a, x| (a << 8) | u64::from(*x))),
        _ => Err(bad(what)),
    }
}

fn hash_list(v: &Val, what: &str) -> Result<Vec<u64>, DecodeError> {
    as_list(v, what)?.iter().map(|x| as_hash(x, what)).collect()
}

fn decode_event(v: &Val) -> Result<KvEvent, DecodeError> {
    let Val::Map(fields) = v else {
        return Err(bad("an event (a msgpack map)"));
    };
    let get = |k: &str| {
        fields
            .iter()
            .find(|(name, _)| matches!(name, Val::Str(s) if s == k))
            .map(|(_, v)| v)
    };
    let need = |k: &str| get(k).ok_or_else(|| bad(&format!("field {k:?}")));
    // Optional strings are read where present: vLLM always writes `medium` and `lora_name`
    // (no default, so never omitted), SGLang leaves them out when `None` (defaults).
    let opt_str_field = |k: &str| -> Result<Option<String>, DecodeError> {
        get(k)
            .map(|v| as_opt_str(v, k))
            .transpose()
            .map(Option::flatten)
    };
    let opt_u32 = |k: &str| -> Result<Option<u32>, DecodeError> {
        get(k)
            .map(|v| as_opt_u64(v, k).map(|o| o.map(|x| x as u32)))
            .transpose()
            .map(Option::flatten)
    };
    match need("type")? {
        Val::Str(t) if t == "BlockStored" => {
            let extra_keys = match get("extra_keys") {
                None | Some(Val::Nil) => None,
                Some(v) => Some(
                    as_list(v, "extra_keys")?
                        .iter()
                        .map(|k| match k {
                            Val::Nil => Ok(None),
                            Val::Array(parts) => {
                                Ok(Some(parts.iter().map(decode_extra_key).collect()))
                            }
                            _ => Err(bad("extra_keys entries")),
                        })
                        .collect::<Result<Vec<_>, _>>()?,
                ),
            };
            Ok(KvEvent::BlockStored {
                block_hashes: hash_list(need("block_hashes")?, "block_hashes")?,
                parent_block_hash: match need("parent_block_hash")? {
                    Val::Nil => None,
                    v => Some(as_hash(v, "parent_block_hash")?),
                },
                token_ids: u64s(need("token_ids")?, "token_ids")?
                    .into_iter()
                    .map(|t| t as u32)
                    .collect(),
                block_size: as_u64(need("block_size")?, "block_size")? as u32,
                lora_id: match get("lora_id") {
                    None | Some(Val::Nil) => None,
                    Some(Val::Int(i)) => Some(*i as i64),
                    Some(_) => return Err(bad("lora_id")),
                },
                medium: opt_str_field("medium")?,
                lora_name: opt_str_field("lora_name")?,
                extra_keys,
                group_idx: opt_u32("group_idx")?,
                kv_cache_spec_kind: opt_str_field("kv_cache_spec_kind")?,
                session_id: opt_str_field("session_id")?,
                cache_salt: opt_str_field("cache_salt")?,
            })
        }
        Val::Str(t) if t == "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: hash_list(need("block_hashes")?, "block_hashes")?,
            medium: opt_str_field("medium")?,
            group_idx: opt_u32("group_idx")?,
        }),
        Val::Str(t) if t == "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        Val::Str(t) => Ok(KvEvent::Other { kind: t.clone() }),
        other => Err(bad(&format!("an event type name, not {other:?}"))),
    }
}

/// Decodes a PUB payload (or a replayed one) into a batch.
///
/// # Errors
/// [`DecodeError`] when the bytes are not a msgpack `KVEventBatch` with known event types.
pub fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, DecodeError> {
    let mut r = Reader {
        buf: payload,
        at: 0,
        depth: 0,
    };
    let v = r.value()?;
    if r.at != payload.len() {
        return Err(r.err("end of payload"));
    }
    let items = as_list(&v, "a batch (a msgpack array)")?;
    let ts = match items.first() {
        Some(Val::Float(f)) => *f,
        Some(Val::Int(i)) => *i as f64,
        _ => return Err(bad("ts")),
    };
    let events = as_list(items.get(1).ok_or_else(|| bad("events"))?, "events")?
        .iter()
        .map(decode_event)
        .collect::<Result<Vec<_>, _>>()?;
    let data_parallel_rank = match items.get(2) {
        None | Some(Val::Nil) => None,
        Some(Val::Int(i)) => Some(*i as i64),
        Some(_) => return Err(bad("data_parallel_rank")),
    };
    Ok(KvEventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(n: usize) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: (0..n as u64).map(|i| u64::MAX - i).collect(),
            parent_block_hash: Some(7),
            token_ids: (0..n as u32 * 4).collect(),
            block_size: 4,
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_string()),
            lora_name: None,
            extra_keys: Some(vec![None; n]),
            group_idx: Some(0),
            kv_cache_spec_kind: None,
            session_id: None,
            cache_salt: None,
        }
    }

    /// SGLang's encoding decodes to the events it was made from: signed hashes (negative for
    /// half of SGLang's blocks) read back as the same 64 bits, the optional strings it leaves
    /// out when unset read as `None`, its `cache_salt` kept. Before, every SGLang batch failed
    /// to decode (a negative hash, then the missing `lora_name`).
    #[test]
    fn sglangs_encoding_decodes_to_the_same_events() {
        let salted = KvEvent::BlockStored {
            block_hashes: vec![u64::MAX, 1 << 63, 5],
            parent_block_hash: Some(u64::MAX - 1),
            token_ids: (0..3).collect(),
            block_size: 1,
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_string()),
            lora_name: Some("adapter-a".into()),
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            session_id: None,
            cache_salt: Some("tenant-1".into()),
        };
        let plain = KvEvent::BlockStored {
            block_hashes: vec![9],
            parent_block_hash: None,
            token_ids: vec![7],
            block_size: 1,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            session_id: None,
            cache_salt: None,
        };
        let removed = KvEvent::BlockRemoved {
            block_hashes: vec![u64::MAX],
            medium: Some("CPU_PINNED".into()),
            group_idx: None,
        };
        let b = KvEventBatch {
            ts: 2.5,
            events: vec![salted, plain, removed, KvEvent::AllBlocksCleared],
            data_parallel_rank: Some(1),
        };
        let bytes = encode_sglang_batch(&b);
        assert_eq!(decode_batch(&bytes).unwrap(), b);
        // -1 is one byte (a negative fixint), not a u64: SGLang's signed hashes.
        assert!(bytes.windows(2).any(|w| w == [0x93, 0xff]), "{bytes:02x?}");
        // A hash as bytes (vLLM without int hashes) keys by its last 8 bytes.
        let mut w = Vec::new();
        array(&mut w, 2);
        let _ = rmp::encode::write_f64(&mut w, 0.0);
        array(&mut w, 1);
        let _ = rmp::encode::write_map_len(&mut w, 3);
        str(&mut w, "type");
        str(&mut w, "BlockRemoved");
        str(&mut w, "block_hashes");
        array(&mut w, 1);
        let _ = rmp::encode::write_bin(
            &mut w,
            &[0xaa; 24].iter().copied().chain(1..=8).collect::<Vec<u8>>(),
        );
        str(&mut w, "medium");
        nil(&mut w);
        let got = decode_batch(&w).unwrap();
        assert_eq!(
            got.events,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![0x0102_0304_0506_0708],
                medium: None,
                group_idx: None
            }]
        );
    }

    /// A payload of deeply nested arrays is refused, not decoded by recursion until the
    /// stack overflows (it aborted the process). Found by the `kv_events` fuzz target
    /// (tests/fuzz/regressions/kv_events/deep_nesting).
    #[test]
    fn deeply_nested_payloads_are_refused_without_overflowing_the_stack() {
        let mut deep = vec![0x91u8; 1_000_000];
        deep.push(0xc0);
        let err = decode_batch(&deep).unwrap_err();
        assert!(err.what.contains("nesting"), "{err}");
    }

    #[test]
    fn round_trips() {
        let b = KvEventBatch {
            ts: 1.5,
            events: vec![
                stored(2),
                KvEvent::BlockRemoved {
                    block_hashes: vec![300],
                    medium: Some(MEDIUM_GPU.to_string()),
                    group_idx: Some(0),
                },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        };
        assert_eq!(decode_batch(&encode_batch(&b)).unwrap(), b);
    }

    #[test]
    fn all_blocks_cleared_is_a_one_entry_map() {
        let b = KvEventBatch {
            ts: 0.0,
            events: vec![KvEvent::AllBlocksCleared],
            data_parallel_rank: Some(0),
        };
        let mut want = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x81, 0xa4];
        want.extend_from_slice(b"type");
        want.push(0xb0);
        want.extend_from_slice(b"AllBlocksCleared");
        want.push(0x00);
        assert_eq!(encode_batch(&b), want);
    }

    /// An event of a type a newer engine adds is decoded as `Other`, and the rest of its
    /// batch with it.
    #[test]
    fn an_unknown_event_type_is_kept_by_name_with_its_batch() {
        let batch = KvEventBatch {
            ts: 1.0,
            events: vec![
                KvEvent::Other {
                    kind: "BlockPromoted".into(),
                },
                stored(2),
            ],
            data_parallel_rank: Some(0),
        };
        assert_eq!(decode_batch(&encode_batch(&batch)).expect("decodes"), batch);
    }

    /// Every shape vLLM publishes in `extra_keys` decodes: adapter names and salts
    /// (strings), multimodal `(identifier, offset)` pairs, prompt-embedding digests (bytes);
    /// a shape no engine sends yet is kept as it came, and the batch with it. Before, one
    /// image request's store failed its whole batch.
    #[test]
    fn every_extra_key_shape_decodes_and_re_encodes() {
        let odd = {
            let mut w = Vec::new();
            array(&mut w, 3);
            str(&mut w, "x");
            int(&mut w, -3);
            let _ = rmp::encode::write_f64(&mut w, 0.5);
            w
        };
        let mut e = stored(3);
        if let KvEvent::BlockStored {
            extra_keys,
            lora_name,
            ..
        } = &mut e
        {
            *lora_name = Some("adapter-a".into());
            *extra_keys = Some(vec![
                Some(vec![
                    ExtraKey::Text("adapter-a".into()),
                    ExtraKey::Media {
                        identifier: "img-0".into(),
                        offset: -4,
                    },
                    ExtraKey::Text("tenant-1".into()),
                ]),
                Some(vec![ExtraKey::Digest(vec![0, 255, 16])]),
                Some(vec![ExtraKey::Other(odd)]),
            ]);
        }
        let b = KvEventBatch {
            ts: 3.0,
            events: vec![e],
            data_parallel_rank: Some(0),
        };
        let bytes = encode_batch(&b);
        assert_eq!(decode_batch(&bytes).expect("decodes"), b);
        assert_eq!(encode_batch(&decode_batch(&bytes).unwrap()), bytes);
    }

    #[test]
    fn truncated_payload_is_an_error() {
        let b = KvEventBatch {
            ts: 2.0,
            events: vec![stored(1)],
            data_parallel_rank: Some(0),
        };
        let bytes = encode_batch(&b);
        assert!(decode_batch(&bytes[..bytes.len() - 1]).is_err());
    }
}
