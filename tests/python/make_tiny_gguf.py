"""Writes a tiny llama-architecture GGUF model with random weights for llama.cpp's server.

Usage: python make_tiny_gguf.py OUT.gguf [--ctx TOKENS] [--seed N]

The model is for end-to-end tests of the router against a real llama.cpp server
(tests/tests/e2e/llamacpp_e2e.rs): it loads, tokenizes and generates like any llama model, and its
output is gibberish made of the vocabulary's words. Shape:

- architecture `llama`: 2 blocks, embedding 64, 4 attention heads (head size 16, no grouped-query
  sharing), feed-forward 128, RMS-norm epsilon 1e-5, RoPE base 10000; float32 weights, N(0, 0.5).
- context length `--ctx` tokens (default 256: llama.cpp pads a context to a multiple of 256, so a
  smaller one would be served as 256 anyway), so an over-long prompt is a few hundred words.
- tokenizer `llama` (SentencePiece-style, what llama.cpp calls SPM): `<unk>` 0, `<s>` 1 (BOS,
  prepended), `</s>` 2 (EOS), the 256 byte-fallback tokens `<0x00>`..`<0xFF>` (llama.cpp requires
  them for SPM, e.g. for the newline token), then single characters and about 150 words written
  with `▁` for a leading space (with their prefixes, so each of these words is one token). Any
  text tokenizes (other words are spelled out, unknown characters fall back to bytes).
- the output projection rows of every non-word token (specials, bytes) are zero while the word
  rows are random, so greedy decoding never picks EOS or a raw byte and answers are never empty:
  text is always printable ASCII words, and generation runs to `max_tokens` unless a stop
  sequence ends it.
- a minimal chat template (`<|role|> content` lines, then `<|assistant|>`), so chat requests use
  the GGUF's own template as real models' do.

The same seed gives a byte-identical file. Exits non-zero with a message on bad arguments.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import gguf

N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
WEIGHT_STD = 0.5

WORDS = """
the of and to in is was for on that with as by at from his her it an were are which this be
or has had one first their its new after who they have two been also but not all can more
when time year would there other into only most some may over any such river city house
light water stone cloud green quiet bright small large early late north south east west red
blue gold silver paper music garden window market bridge forest island winter summer autumn
spring morning evening signal engine router token model vector matrix kernel socket packet
""".split()

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def vocabulary() -> tuple[list[str], list[float], list[int], list[bool]]:
    """Tokens, SPM scores, token types and a per-token 'may be generated' flag."""
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    scores: list[float] = [0.0, 0.0, 0.0]
    types: list[int] = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(gguf.TokenType.BYTE)
    # Single characters (any word can be spelled), every prefix of every word with its leading
    # `▁` (SPM merges adjacent pieces only into pieces that exist, so a word is one token only
    # if its prefixes are pieces too), then the whole words.
    pieces: list[str] = ["▁"] + list("abcdefghijklmnopqrstuvwxyz0123456789.,!?")
    for w in WORDS:
        pieces += ["▁" + w[:n] for n in range(1, len(w) + 1)]
    whole = {"▁" + w for w in WORDS}
    index = {t: i for i, t in enumerate(tokens)}
    for p in pieces:
        if p in index:
            continue
        index[p] = len(tokens)
        tokens.append(p)
        scores.append(float(len(p)))  # longer merges first
        types.append(gguf.TokenType.NORMAL)
    generatable = [tok in whole for tok in tokens]
    return tokens, scores, types, generatable


def write(path: str, ctx: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens, scores, types, generatable = vocabulary()
    n_vocab = len(tokens)
    head_dim = N_EMBD // N_HEAD

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("narwhal-tiny-llama")
    w.add_context_length(ctx)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    T = gguf.MODEL_TENSOR

    def name(t: gguf.MODEL_TENSOR, bid: int | None = None) -> str:
        base = gguf.TENSOR_NAMES[t]
        return (base.format(bid=bid) if bid is not None else base) + ".weight"

    # numpy shapes are (rows, cols); GGUF stores them reversed, as llama.cpp expects
    # (token_embd: ne = [n_embd, n_vocab]).
    w.add_tensor(name(T.TOKEN_EMBD), rand(n_vocab, N_EMBD))
    for b in range(N_LAYER):
        w.add_tensor(name(T.ATTN_NORM, b), np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(name(T.ATTN_Q, b), rand(N_HEAD * head_dim, N_EMBD))
        w.add_tensor(name(T.ATTN_K, b), rand(N_HEAD * head_dim, N_EMBD))
        w.add_tensor(name(T.ATTN_V, b), rand(N_HEAD * head_dim, N_EMBD))
        w.add_tensor(name(T.ATTN_OUT, b), rand(N_EMBD, N_HEAD * head_dim))
        w.add_tensor(name(T.FFN_NORM, b), np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(name(T.FFN_GATE, b), rand(N_FF, N_EMBD))
        w.add_tensor(name(T.FFN_UP, b), rand(N_FF, N_EMBD))
        w.add_tensor(name(T.FFN_DOWN, b), rand(N_EMBD, N_FF))
    w.add_tensor(name(T.OUTPUT_NORM), np.ones(N_EMBD, dtype=np.float32))
    out = rand(n_vocab, N_EMBD)
    out[~np.array(generatable)] = 0.0
    w.add_tensor(name(T.OUTPUT), out)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="path of the .gguf file to write")
    ap.add_argument("--ctx", type=int, default=256, help="context length in tokens (default 256)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = ap.parse_args(argv)
    if args.ctx < 16:
        ap.error(f"--ctx {args.ctx}: must be at least 16 tokens")
    write(args.out, args.ctx, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
