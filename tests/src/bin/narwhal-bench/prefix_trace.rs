//! The shared-prefix trace of `narwhal-bench prefix` and its offline oracle.
//!
//! ```text
//!  seed ─► arrival order: each arrival is a group question (a group's long shared prefix and
//!          a short unique question) or the next turn of a multi-turn session (the session's
//!          previous prompt, a stand-in for the previous answer and a new user message)
//!       ─► Poisson times at the rate (the order does not depend on the rate)
//!  order ─► oracle: one pooled LRU block cache of every engine's capacity, requests in order
//! ```
//!
//! A prompt is whitespace-separated words, one simulator token each (the simulator's
//! tokenizer: `tests/src/bin/narwhal-engine-sim/tokenizer.rs`), so every router (ours through
//! the engines' `/tokenize`, the peers on the text) sees the same prefixes.

use std::collections::{BTreeMap, HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One run of words of a prompt: `len` words `"{tag}w{i}"`, `i` in `0..len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Names the run (`g3`: group 3's prefix, `q17`: question 17, `s4u2`: session 4's second
    /// user message, `s4a1`: the stand-in for its first answer).
    pub(crate) tag: String,
    /// Words (tokens) in the run.
    pub(crate) len: usize,
}

/// What a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A group's shared prefix and a unique question.
    Question,
    /// Turn `n` (1-based) of a session.
    Turn(usize),
}

/// One request of the trace.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    /// Seconds from the start of the run when it is sent.
    pub(crate) at_s: f64,
    /// What it is.
    pub(crate) kind: Kind,
    /// The prompt, in order.
    pub(crate) segments: Vec<Segment>,
    /// The tenant's `cache_salt` (`t3`), when the trace has tenants: vLLM keys the first
    /// block's hash (so the whole chain) by it, and tenants share no cached block.
    pub(crate) salt: Option<String>,
    /// Sent straight to an engine, as a second router would, not to the target.
    pub(crate) direct: bool,
    /// A chat completion whose first segment is the `tools` block (an agent's tool
    /// definitions) and whose others are the messages, user and assistant in turn; else a
    /// completion of the segments' text.
    pub(crate) chat: bool,
}

impl Request {
    /// Prompt tokens.
    pub(crate) fn tokens(&self) -> usize {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// The prompt text: the segments' words joined by spaces.
    pub(crate) fn text(&self) -> String {
        let mut out = String::with_capacity(self.tokens() * 9);
        for s in &self.segments {
            for i in 0..s.len {
                if !out.is_empty() {
                    out.push(' ');
                }
                out.push_str(&s.tag);
                out.push('w');
                out.push_str(&i.to_string());
            }
        }
        out
    }

    /// The streamed completion request's body: `model`, the prompt, `max_tokens`, and the
    /// tenant's `cache_salt`.
    pub(crate) fn body(&self, model: &str, max_tokens: u32) -> serde_json::Value {
        let mut b = if self.chat {
            self.chat_body(model, max_tokens)
        } else {
            serde_json::json!({"model": model, "prompt": self.text(),
                               "max_tokens": max_tokens, "stream": true})
        };
        if let Some(salt) = &self.salt {
            b["cache_salt"] = salt.clone().into();
        }
        b
    }

    /// The chat form ([`Request::chat`]): one function whose description is the first
    /// segment's words (the simulator renders `tools` before the messages, as chat templates
    /// do), then the other segments as messages, user first.
    fn chat_body(&self, model: &str, max_tokens: u32) -> serde_json::Value {
        let words = |s: &Segment| {
            (0..s.len)
                .map(|i| format!("{}w{i}", s.tag))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let (tools, rest) = self
            .segments
            .split_first()
            .expect("a request has a segment");
        let messages: Vec<serde_json::Value> = rest
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                serde_json::json!({"role": role, "content": words(s)})
            })
            .collect();
        serde_json::json!({
            "model": model, "messages": messages, "max_tokens": max_tokens, "stream": true,
            "tools": [{"type": "function", "function": {
                "name": tools.tag, "description": words(tools),
                "parameters": {"type": "object", "properties": {}}}}],
        })
    }

    /// Where a second router placing by prefix affinity sends it (the bypass): a hash of its
    /// first segment (a group's prefix, or a question's own) and its salt.
    pub(crate) fn affinity(&self) -> u64 {
        let first = self.segments.first().map_or("", |s| s.tag.as_str());
        let salt = self.salt.as_deref().unwrap_or("");
        fnv(
            salt.as_bytes(),
            fnv(first.as_bytes(), 0xcbf2_9ce4_8422_2325),
        )
    }

    /// A stable id per token (hash of its word), in prompt order: what the oracle's blocks
    /// are made of.
    fn token_ids(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.tokens());
        for s in &self.segments {
            let base = fnv(s.tag.as_bytes(), 0xcbf2_9ce4_8422_2325);
            for i in 0..s.len {
                out.push(fnv(&(i as u64).to_le_bytes(), base));
            }
        }
        out
    }
}

fn fnv(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The workload's shape (the `narwhal-bench prefix` flags of the same names).
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    /// Groups sharing a prefix.
    pub(crate) groups: usize,
    /// Shortest and longest group prefix, tokens (uniform between them).
    pub(crate) prefix_tokens: (usize, usize),
    /// Tokens of a unique question.
    pub(crate) question_tokens: usize,
    /// Sessions running at once.
    pub(crate) sessions: usize,
    /// Turns of a session.
    pub(crate) turns: usize,
    /// Tokens of a session's user message per turn.
    pub(crate) user_tokens: usize,
    /// Tokens standing in for the previous answer in the next turn's prompt.
    pub(crate) answer_tokens: usize,
    /// Share of arrivals that are session turns (0-1).
    pub(crate) session_share: f64,
    /// Zipf exponent of group popularity (0: uniform).
    pub(crate) zipf: f64,
    /// Seconds at least between two turns of one session.
    pub(crate) turn_gap_s: f64,
    /// Tenants (`cache_salt` values, uniform; 0: none): a session keeps its tenant.
    pub(crate) tenants: usize,
    /// Share of requests sent straight to an engine (0-1).
    pub(crate) bypass: f64,
    /// Agents: every request a chat completion whose group prefix is its `tools` block, and a
    /// session's next turn due a think time after its last (uniform in `think_s`), not
    /// `turn_gap_s`.
    pub(crate) agents: Option<(f64, f64)>,
}

struct Session {
    id: usize,
    group: usize,
    tenant: Option<String>,
    turn: usize,
    /// When its next turn may come (seconds from the start).
    due_s: f64,
}

/// Builds `n` requests at Poisson arrivals of `rate` per second from `seed`. The prompts
/// and their order depend on the seed only (a session's minimum turn gap aside, which is
/// checked against the arrival times). Tenants and bypass draw from the generator only when
/// they are on, so a trace without them is the same as before they existed.
pub(crate) fn generate(shape: &Shape, rate: f64, duration_s: f64, seed: u64) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(seed);
    let lens: Vec<usize> = (0..shape.groups)
        .map(|_| rng.random_range(shape.prefix_tokens.0..=shape.prefix_tokens.1))
        .collect();
    let weights: Vec<f64> = (0..shape.groups)
        .map(|g| 1.0 / ((g + 1) as f64).powf(shape.zipf))
        .collect();
    let total: f64 = weights.iter().sum();
    let pick_group = |rng: &mut StdRng| {
        let mut x = rng.random::<f64>() * total;
        for (g, w) in weights.iter().enumerate() {
            if x < *w {
                return g;
            }
            x -= w;
        }
        shape.groups - 1
    };
    let pick_tenant = |rng: &mut StdRng| {
        (shape.tenants > 0).then(|| format!("t{}", rng.random_range(0..shape.tenants)))
    };
    let mut next_session = 0usize;
    let mut sessions: Vec<Session> = (0..shape.sessions)
        .map(|_| {
            next_session += 1;
            Session {
                id: next_session - 1,
                group: pick_group(&mut rng),
                tenant: pick_tenant(&mut rng),
                turn: 0,
                due_s: f64::NEG_INFINITY,
            }
        })
        .collect();
    let mut out = Vec::new();
    let mut t = 0.0;
    let mut question = 0usize;
    loop {
        t += -(1.0 - rng.random::<f64>()).ln() / rate;
        if t >= duration_s {
            break;
        }
        let turn = shape.sessions > 0 && rng.random::<f64>() < shape.session_share;
        let slot = rng.random_range(0..shape.sessions.max(1));
        if turn && t >= sessions[slot].due_s {
            let gap = match shape.agents {
                Some((lo, hi)) => rng.random_range(lo..=hi.max(lo)),
                None => shape.turn_gap_s,
            };
            let s = &mut sessions[slot];
            s.turn += 1;
            s.due_s = t + gap;
            let mut segments = vec![Segment {
                tag: format!("g{}", s.group),
                len: lens[s.group],
            }];
            for k in 1..=s.turn {
                if k > 1 {
                    segments.push(Segment {
                        tag: format!("s{}a{}", s.id, k - 1),
                        len: shape.answer_tokens,
                    });
                }
                segments.push(Segment {
                    tag: format!("s{}u{k}", s.id),
                    len: shape.user_tokens,
                });
            }
            out.push(Request {
                at_s: t,
                kind: Kind::Turn(s.turn),
                segments,
                salt: s.tenant.clone(),
                direct: false,
                chat: shape.agents.is_some(),
            });
            if s.turn >= shape.turns {
                let group = pick_group(&mut rng);
                let tenant = pick_tenant(&mut rng);
                next_session += 1;
                sessions[slot] = Session {
                    id: next_session - 1,
                    group,
                    tenant,
                    turn: 0,
                    due_s: t + gap,
                };
            }
        } else {
            let g = pick_group(&mut rng);
            question += 1;
            out.push(Request {
                at_s: t,
                kind: Kind::Question,
                segments: vec![
                    Segment {
                        tag: format!("g{g}"),
                        len: lens[g],
                    },
                    Segment {
                        tag: format!("q{question}"),
                        len: shape.question_tokens,
                    },
                ],
                salt: pick_tenant(&mut rng),
                direct: false,
                chat: shape.agents.is_some(),
            });
        }
        if shape.bypass > 0.0
            && let Some(last) = out.last_mut()
        {
            last.direct = rng.random::<f64>() < shape.bypass;
        }
    }
    out
}

/// The oracle's figures for a trace.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Oracle {
    /// Prompt tokens of the trace.
    pub(crate) tokens: u64,
    /// Tokens the pooled LRU cache hits.
    pub(crate) hits: u64,
    /// Tokens an unbounded cache would hit (every full block seen before): the trace's reuse.
    pub(crate) reuse_hits: u64,
}

impl Oracle {
    /// Token hit rate of the pooled LRU cache (0-1).
    pub(crate) fn hit_rate(&self) -> f64 {
        self.hits as f64 / self.tokens.max(1) as f64
    }

    /// Token hit rate of an unbounded cache (0-1).
    pub(crate) fn reuse_rate(&self) -> f64 {
        self.reuse_hits as f64 / self.tokens.max(1) as f64
    }

    /// Mean prompt tokens the pooled cache leaves to compute, per request.
    pub(crate) fn mean_uncached(&self, requests: usize) -> f64 {
        (self.tokens - self.hits) as f64 / requests.max(1) as f64
    }
}

/// A block prefix cache as the simulator's (and vLLM V1's) works: a hit is the run of cached
/// leading full blocks, at most `(len - 1) / block_size` of them; the prompt's full blocks are
/// then stored, the least recently used blocks of other prompts evicted to make room.
struct Lru {
    capacity: usize,
    blocks: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, h: u64) {
        self.tick += 1;
        if let Some(old) = self.blocks.insert(h, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, h);
    }

    /// Looks `hashes` (a prompt of `len` tokens) up and stores them; the hit in blocks.
    fn serve(&mut self, hashes: &[u64], len: usize, block_size: usize) -> usize {
        let max = len.saturating_sub(1) / block_size;
        let hit = hashes
            .iter()
            .take(max)
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        let mine: HashSet<u64> = hashes.iter().copied().collect();
        for h in hashes {
            if !self.blocks.contains_key(h) && self.blocks.len() >= self.capacity {
                let victim = self
                    .order
                    .iter()
                    .find(|(_, v)| !mine.contains(v))
                    .map(|(t, v)| (*t, *v));
                let Some((t, v)) = victim else { break };
                self.order.remove(&t);
                self.blocks.remove(&v);
            }
            self.touch(*h);
        }
        hit
    }
}

/// The full blocks' chained hashes of a prompt.
fn block_hashes(req: &Request, block_size: usize) -> Vec<u64> {
    let ids = req.token_ids();
    let mut parent = req
        .salt
        .as_ref()
        .map_or(0, |s| fnv(s.as_bytes(), 0xcbf2_9ce4_8422_2325));
    ids.chunks_exact(block_size)
        .map(|c| {
            let mut h = fnv(&parent.to_le_bytes(), 0xcbf2_9ce4_8422_2325);
            for t in c {
                h = fnv(&t.to_le_bytes(), h);
            }
            parent = h;
            h
        })
        .collect()
}

/// The oracle of `trace`: every request, in arrival order, served by one cache of
/// `capacity_blocks` (all engines' together) with the engines' block size and LRU rule, each
/// request's lookup and store taking no time and no engine restarting; and the unbounded
/// cache's figure beside it.
pub(crate) fn oracle(trace: &[Request], block_size: usize, capacity_blocks: usize) -> Oracle {
    let mut lru = Lru {
        capacity: capacity_blocks,
        blocks: HashMap::new(),
        order: BTreeMap::new(),
        tick: 0,
    };
    let mut seen: HashSet<u64> = HashSet::new();
    let mut o = Oracle::default();
    for r in trace {
        let len = r.tokens();
        let hashes = block_hashes(r, block_size);
        o.tokens += len as u64;
        o.hits += (lru.serve(&hashes, len, block_size) * block_size) as u64;
        let max = len.saturating_sub(1) / block_size;
        let reuse = hashes
            .iter()
            .take(max)
            .take_while(|h| seen.contains(h))
            .count();
        o.reuse_hits += (reuse * block_size) as u64;
        seen.extend(hashes);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            groups: 4,
            prefix_tokens: (64, 128),
            question_tokens: 8,
            sessions: 2,
            turns: 3,
            user_tokens: 8,
            answer_tokens: 8,
            session_share: 0.4,
            zipf: 0.0,
            turn_gap_s: 0.0,
            tenants: 0,
            bypass: 0.0,
            agents: None,
        }
    }

    #[test]
    fn every_turn_extends_the_last_turn_of_its_session() {
        let trace = generate(&shape(), 10.0, 20.0, 7);
        let mut last: HashMap<String, Vec<Segment>> = HashMap::new();
        let mut turns = 0;
        for r in &trace {
            if let Kind::Turn(n) = r.kind {
                turns += 1;
                let session = r.segments[1].tag.split('u').next().unwrap().to_string();
                if n > 1 {
                    let prev = &last[&session];
                    assert_eq!(&r.segments[..prev.len()], &prev[..], "{session} turn {n}");
                    assert_eq!(r.segments.len(), prev.len() + 2);
                }
                last.insert(session, r.segments.clone());
            }
        }
        assert!(turns > 10, "{turns} turns");
    }

    #[test]
    fn the_oracle_hits_a_repeated_prefix_and_loses_it_to_another_prompt() {
        let q = |group: &str, tag: &str| Request {
            at_s: 0.0,
            kind: Kind::Question,
            segments: vec![
                Segment {
                    tag: group.into(),
                    len: 64,
                },
                Segment {
                    tag: tag.into(),
                    len: 8,
                },
            ],
            salt: None,
            direct: false,
            chat: false,
        };
        // 72 tokens: 4 full blocks of 16, all of the shared prefix.
        let twice = vec![q("g0", "q1"), q("g0", "q2")];
        let big = oracle(&twice, 16, 100);
        assert_eq!((big.tokens, big.hits, big.reuse_hits), (144, 64, 64));
        // Room for 2 blocks: a prompt never evicts its own blocks, so the first 2 stay.
        assert_eq!(oracle(&twice, 16, 2).hits, 32);
        // Room for 4: another group's prefix evicts g0's (least recently used) blocks.
        let between = vec![q("g0", "q1"), q("g1", "q2"), q("g0", "q3")];
        let small = oracle(&between, 16, 4);
        assert_eq!((small.hits, small.reuse_hits), (0, 64));
        assert_eq!(oracle(&between, 16, 8).hits, 64);
    }

    #[test]
    fn tenants_keep_their_salt_per_session_and_share_no_block() {
        let shp = Shape {
            tenants: 3,
            bypass: 0.25,
            ..shape()
        };
        let trace = generate(&shp, 10.0, 60.0, 3);
        // Tenants and bypass draw from the generator on top of the same prompts and order.
        let plain = generate(&shape(), 10.0, 60.0, 3);
        assert_ne!(trace.len(), 0);
        let mut salt_of: HashMap<String, Option<String>> = HashMap::new();
        for r in trace.iter().filter(|r| matches!(r.kind, Kind::Turn(_))) {
            let session = r.segments[1].tag.split('u').next().unwrap().to_string();
            let was = salt_of.entry(session.clone()).or_insert(r.salt.clone());
            assert_eq!(*was, r.salt, "{session} changed tenant");
        }
        assert!(trace.iter().all(|r| r.salt.is_some()));
        assert!(plain.iter().all(|r| r.salt.is_none() && !r.direct));
        let direct = trace.iter().filter(|r| r.direct).count() as f64 / trace.len() as f64;
        assert!((0.15..0.35).contains(&direct), "bypass share {direct}");
        assert_eq!(
            trace[0].body("m", 4)["cache_salt"],
            serde_json::json!(trace[0].salt.clone().unwrap())
        );
        // One prompt under two salts: nothing shared; under one salt twice: its blocks hit.
        let salted = |salt: &str| Request {
            salt: Some(salt.into()),
            ..trace[0].clone()
        };
        let two = oracle(&[salted("t0"), salted("t1")], 16, 1000);
        assert_eq!(two.reuse_hits, 0);
        let same = oracle(&[salted("t0"), salted("t0")], 16, 1000);
        assert!(same.reuse_hits > 0);
    }
}
