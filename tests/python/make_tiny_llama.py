#!/usr/bin/env python3
"""Writes the tiny model the real-vLLM end-to-end stage serves (tests/tests/vllm_e2e.rs), offline:
a 2-layer Llama (hidden 128, random weights from seed 1234, float32) with a byte-level BPE
tokenizer trained here on a fixed corpus and a chat template. Its answers are random text, but at
temperature 0 (or with a seed) they are deterministic, which is all a comparison needs.

Usage: make_tiny_llama.py OUT_DIR   (run with the vLLM venv's interpreter: torch, transformers,
tokenizers)."""
import json
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 1234
out = sys.argv[1]
os.makedirs(out, exist_ok=True)

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = (
    "the quick brown fox jumps over the lazy dog while narwhal routers place requests on "
    "prefill and decode engines and stream tokens back to every client hello world one two "
    "three four five six seven eight nine ten alpha beta gamma delta kv cache transfer "
    "block engine agent drain readmit health model served tiny llama vllm cpu"
).split()
corpus = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(24)) for i in range(400)]
corpus += ["0123456789 !?.,:;'\"()[]{}<>+-*/=_#@$%^&|~`\\ \n\t"] * 10

tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=1024,
    special_tokens=SPECIAL,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train_from_iterator(corpus, trainer=trainer)
bos = tok.token_to_id("<s>")
eos = tok.token_to_id("</s>")
tok.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
)

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
fast = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    bos_token="<s>",
    eos_token="</s>",
    unk_token="<unk>",
    pad_token="</s>",
    additional_special_tokens=SPECIAL[3:],
    model_max_length=2048,
    chat_template=CHAT,
)
fast.save_pretrained(out)

cfg = LlamaConfig(
    vocab_size=tok.get_vocab_size(),
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    bos_token_id=bos,
    eos_token_id=eos,
    pad_token_id=eos,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
torch.manual_seed(SEED)
model = LlamaForCausalLM(cfg).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
# The chat template in tokenizer_config.json as well: older readers look only there.
tc_path = os.path.join(out, "tokenizer_config.json")
with open(tc_path) as f:
    tc = json.load(f)
tc.setdefault("chat_template", CHAT)
with open(tc_path, "w") as f:
    json.dump(tc, f, indent=2)
print("wrote", out, "vocab", tok.get_vocab_size(), "params", sum(p.numel() for p in model.parameters()))
