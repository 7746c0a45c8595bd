"""Reference bytes for the engine simulator's KV events (tests/tests/e2e/kv_events_e2e.rs).

Publishes a fixed fixture of KV event batches through vLLM's own `ZmqEventPublisher`
(`vllm/distributed/kv_events.py`, the copy shipped in the pinned vLLM wheel), receives them with
a pyzmq SUB socket and once through the publisher's replay ROUTER socket, and prints one JSON
document on stdout:

    {"engine": "vllm", "version": "...", "topic": "...",
     "batches": [{"fixture": {...}, "frames": [topic_hex, seq_hex, payload_hex]}, ...],
     "live": [[topic_hex, seq_hex, payload_hex], ...],   # seq >= len(batches): the last
                                                       # batch published again
     "replay": [[hex, ...], ...]}       # what a DEALER gets back, end marker included

Usage: python kv_events_reference.py vllm VLLM_SRC       (the directory holding `vllm/`)
       python kv_events_reference.py sglang SGLANG_SRC   (the directory holding `sglang/`)
as tests/python/ensure-venv.sh extracts them from the pinned wheels (vllm-source.txt,
sglang-source.txt). The `sglang` mode publishes its own fixture (`sglang_fixture`) through
SGLang's `ZmqEventPublisher` (`sglang/srt/disaggregation/kv_events.py`); the document's
`version` is then SGLang's.

Why the module is loaded by path, with stubs: `import vllm.distributed.kv_events` runs the
package `__init__`s of `vllm` and `vllm.distributed`, which import torch and the whole engine
(gigabytes). kv_events.py itself needs only msgspec, pyzmq and four vLLM names, which are
given here without changing what is measured (the event classes and the publisher are vLLM's
own code, run unmodified). SGLang's kv_events.py likewise needs two SGLang names, reached only
by its tcp:// endpoint helpers and its scheduler-side rank check, never by the ipc:// publisher
used here: `sglang.srt.runtime_context.get_parallel` and `sglang.srt.utils.network.NetworkAddress`
raise if reached. vLLM's stubs:
- `vllm.logger.init_logger`: the standard library's logging.getLogger.
- `vllm.v1.core.kv_cache_utils.ExternalBlockHash`: the type alias `bytes | int`, as vLLM has it.
- `vllm.config.kv_events.KVEventsConfig`: vLLM's own file, loaded by path; its
  `vllm.config.utils.config` decorator (pydantic validation of engine configs) is a plain
  dataclass here.
- `vllm.utils.network_utils`: only used to bind `tcp://*:0` (the node IP); this script binds
  ipc:// endpoints, so the four helpers raise if reached.
"""

import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time
import types

import zmq


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    m.__path__ = []  # a package, so submodules can be registered under it
    sys.modules[name] = m
    return m


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _unreachable(*_a, **_k):
    raise RuntimeError("network_utils is stubbed: bind an explicit endpoint")


def load_vllm(src):
    import logging

    for pkg in ("vllm", "vllm.config", "vllm.distributed", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        _module(pkg)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    _module(
        "vllm.utils.network_utils",
        get_ip=_unreachable,
        get_tcp_uri=_unreachable,
        is_valid_ipv6_address=_unreachable,
        split_zmq_path=_unreachable,
    )
    _module("vllm.config.utils", config=dataclasses.dataclass)
    _load("vllm.config.kv_events", os.path.join(src, "vllm", "config", "kv_events.py"))
    kv = _load("vllm.distributed.kv_events", os.path.join(src, "vllm", "distributed", "kv_events.py"))
    version = {}
    vfile = os.path.join(src, "vllm", "_version.py")
    if os.path.exists(vfile):
        exec(open(vfile).read(), version)  # noqa: S102 - vLLM's generated version file
    return kv, version.get("__version__", "unknown")


class _NoNetworkAddress:
    parse = staticmethod(_unreachable)


def load_sglang(src):
    for pkg in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.utils"):
        _module(pkg)
    _module("sglang.srt.runtime_context", get_parallel=_unreachable)
    _module("sglang.srt.utils.network", NetworkAddress=_NoNetworkAddress)
    kv = _load(
        "sglang.srt.disaggregation.kv_events",
        os.path.join(src, "sglang", "srt", "disaggregation", "kv_events.py"),
    )
    version = {}
    exec(open(os.path.join(src, "sglang", "_version.py")).read(), version)  # noqa: S102
    return kv, version.get("__version__", "unknown")


TOPIC = "kv@sim"
GPU = "GPU"


def fixture():
    """The batches, as plain data (the Rust test builds the same values from this)."""
    tokens = list(range(32))
    return [
        {
            "ts": 1764470400.25,
            "data_parallel_rank": None,  # the publisher fills in its rank (0)
            "events": [
                {"type": "BlockStored", "block_hashes": [1, 2**64 - 1], "parent_block_hash": None,
                 "token_ids": tokens, "block_size": 16, "lora_id": None, "medium": GPU,
                 "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
                 "kv_cache_spec_kind": "full_attention"},
            ],
        },
        {
            "ts": 1764470401.5,
            "data_parallel_rank": 0,
            "events": [
                {"type": "BlockRemoved", "block_hashes": [2**63], "medium": GPU, "group_idx": 0},
                {"type": "BlockStored", "block_hashes": [300], "parent_block_hash": 2**64 - 1,
                 "token_ids": [31999, 65536, 0, 127, 128, 255, 256, 65535, 1, 2, 3, 4, 5, 6, 7, 8],
                 "block_size": 16, "lora_id": 3, "medium": GPU, "lora_name": "adapter-a",
                 "extra_keys": [["adapter-a"]], "group_idx": 0, "session_id": "s1"},
            ],
        },
        {"ts": 1764470402.0, "data_parallel_rank": 0, "events": [{"type": "AllBlocksCleared"}]},
        {
            # Every extra-key shape vLLM publishes (kv_cache_utils.to_event_extra_keys): the
            # adapter's name, a multimodal (identifier, offset) pair, the cache_salt, and a
            # prompt-embeddings digest (bytes; written {"digest": hex} here).
            "ts": 1764470403.0,
            "data_parallel_rank": 0,
            "events": [
                {"type": "BlockStored", "block_hashes": [11, 12, 13], "parent_block_hash": None,
                 "token_ids": list(range(12)), "block_size": 4, "lora_id": 1, "medium": GPU,
                 "lora_name": "adapter-a",
                 "extra_keys": [["adapter-a", ["img-0", 2], "tenant-1"], [["img-0", -2]],
                                [{"digest": "00ff10"}]],
                 "group_idx": 0},
            ],
        },
        {
            "ts": 0.1,
            "data_parallel_rank": 0,
            "events": [
                {"type": "BlockStored", "block_hashes": list(range(20)), "parent_block_hash": 5,
                 "token_ids": list(range(20 * 4)), "block_size": 4, "lora_id": None,
                 "medium": GPU, "lora_name": None, "extra_keys": None},
                {"type": "BlockRemoved", "block_hashes": [7, 8], "medium": None},
            ],
        },
    ]


def sglang_fixture():
    """SGLang's batches, as plain data: block hashes are signed int64 (`hash_str_to_int64`), a
    salted prefix carries `cache_salt` on every store, optional fields are left out when unset,
    lower tiers are `CPU_PINNED` and the like, and a page is the block (page size 1 by
    default)."""
    return [
        {
            "ts": 1764470400.25,
            "data_parallel_rank": None,  # the publisher fills in its rank (0)
            "events": [
                {"type": "BlockStored", "block_hashes": [1, -1, -(2**63)],
                 "parent_block_hash": None, "token_ids": list(range(48)), "block_size": 16,
                 "lora_id": None, "medium": GPU},
            ],
        },
        {
            "ts": 1764470401.5,
            "data_parallel_rank": 0,
            "events": [
                {"type": "BlockRemoved", "block_hashes": [-5, 2**63 - 1], "medium": GPU},
                {"type": "BlockStored", "block_hashes": [2**63 - 1], "parent_block_hash": -1,
                 "token_ids": [31999, 65536, 0, 127, 128, 255, 256, 65535, 1, 2, 3, 4, 5, 6, 7, 8],
                 "block_size": 16, "lora_id": None, "medium": GPU, "cache_salt": "tenant-1",
                 "session_id": "s1", "lora_name": "adapter-a"},
            ],
        },
        {"ts": 1764470402.0, "data_parallel_rank": 0, "events": [{"type": "AllBlocksCleared"}]},
        {
            "ts": 0.1,
            "data_parallel_rank": 0,
            "events": [
                {"type": "BlockStored", "block_hashes": [7, -8], "parent_block_hash": None,
                 "token_ids": [3, 4], "block_size": 1, "lora_id": None, "medium": "CPU_PINNED"},
                {"type": "BlockRemoved", "block_hashes": [7]},
            ],
        },
    ]


def to_sglang(kv, batch):
    events = []
    for e in batch["events"]:
        e = dict(e)
        kind = e.pop("type")
        if e.get("medium") is not None:
            e["medium"] = kv.StorageMedium(e["medium"])  # what SGLang's caches pass
        events.append(getattr(kv, kind)(**e))
    return kv.KVEventBatch(ts=batch["ts"], events=events, attn_dp_rank=batch["data_parallel_rank"])


def _key(part):
    """One extra-key entry of the fixture as vLLM holds it: a pair is a tuple, a digest bytes."""
    if isinstance(part, list):
        return tuple(part)
    if isinstance(part, dict):
        return bytes.fromhex(part["digest"])
    return part


def to_vllm(kv, batch):
    events = []
    for e in batch["events"]:
        e = dict(e)
        kind = e.pop("type")
        if "extra_keys" in e and e["extra_keys"] is not None:
            e["extra_keys"] = [None if k is None else tuple(_key(p) for p in k)
                               for k in e["extra_keys"]]
        events.append(getattr(kv, kind)(**e))
    return kv.KVEventBatch(ts=batch["ts"], events=events, data_parallel_rank=batch["data_parallel_rank"])


ENGINES = {
    # engine: (loader, fixture, conversion, the publisher's rank keyword)
    "vllm": (load_vllm, fixture, to_vllm, "data_parallel_rank"),
    "sglang": (load_sglang, sglang_fixture, to_sglang, "attn_dp_rank"),
}


def main():
    engine, src = sys.argv[1], sys.argv[2]
    load, batches, convert, rank = ENGINES[engine]
    kv, version = load(src)
    with tempfile.TemporaryDirectory(prefix="narwhal-kv-ref-") as d:
        out = run(kv, batches(), lambda b: convert(kv, b), rank, d)
    out["engine"], out["version"] = engine, version
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


def run(kv, batches, convert, rank, d):
    ctx = zmq.Context.instance()
    pub_ep, replay_ep = f"ipc://{d}/pub", f"ipc://{d}/replay"
    publisher = kv.ZmqEventPublisher(
        **{rank: 0}, endpoint=pub_ep, replay_endpoint=replay_ep, topic=TOPIC
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(pub_ep)
    for b in batches:
        publisher.publish(convert(b))
    live = []

    def drain_live():
        while sub.poll(0):
            live.append([f.hex() for f in sub.recv_multipart()])

    # The replay ROUTER is the source of truth for the fixture's sequence numbers 0..n-1. The
    # publisher's thread buffers the batches asynchronously: ask again (with a deadline) until
    # one replay holds them all.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_ep)
    end_seq = (-1).to_bytes(8, "big", signed=True)
    deadline = time.time() + 20
    replay = []
    while time.time() < deadline and len(replay) < len(batches) + 1:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replay = []
        while time.time() < deadline:
            drain_live()
            if dealer.poll(100):
                frames = dealer.recv_multipart()
                replay.append([f.hex() for f in frames])
                if len(frames) >= 3 and frames[2] == end_seq:
                    break
    # PUB/SUB drops what is published before the subscription reaches the publisher, and a
    # SUB joins asynchronously: publish the last fixture batch again, one new sequence number
    # each time, until the SUB has received one of them (a deadline, not a pause).
    again = len(batches)
    deadline = time.time() + 10
    while time.time() < deadline and not any(int(f[1], 16) >= len(batches) for f in live):
        publisher.publish(convert(batches[-1]))
        again += 1
        if sub.poll(100):
            drain_live()
    drain_live()
    publisher.shutdown()
    sub.close(linger=0)
    dealer.close(linger=0)
    # A DEALER gets [b"", topic, seq, payload] per batch, then [b"", b"", END_SEQ, b""].
    end = end_seq.hex()
    by_seq = {int(r[2], 16): r[1:4] for r in replay if len(r) == 4 and r[2] != end}
    return {
        "topic": TOPIC.encode().hex(),
        "batches": [{"fixture": b, "frames": by_seq.get(i)} for i, b in enumerate(batches)],
        "live": live,
        "replay": replay,
    }


if __name__ == "__main__":
    main()
