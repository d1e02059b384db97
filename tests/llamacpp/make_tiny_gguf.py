"""Writes a tiny random-weight llama model in GGUF: a byte-fallback SentencePiece-style vocabulary
of a few hundred tokens, two layers, a 256-token context. Its output is nonsense, but llama.cpp's
server loads it and everything around the model — streaming, usage, the context limit and its
error — is real. No weights are downloaded.

Usage: python make_tiny_gguf.py OUT.gguf
"""

import sys

import numpy as np
import gguf

N_CTX = 256
N_EMBD = 64
N_HEAD = 4
N_FF = 128
N_LAYER = 2

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocab():
    tokens, scores, types = [], [], []

    def add(tok, score, typ):
        tokens.append(tok.encode("utf-8"))
        scores.append(score)
        types.append(typ)

    add("<unk>", 0.0, gguf.TokenType.UNKNOWN)
    add("<s>", 0.0, gguf.TokenType.CONTROL)
    add("</s>", 0.0, gguf.TokenType.CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, gguf.TokenType.BYTE)
    # Some whole-word pieces so ordinary English tokenizes into fewer, realistic tokens.
    words = "the a is of and to in it you that he was for on are with as I his they be at one have this from or had by hot but some what there we can out other were all your when up use word how said an each she which do their time if will way about many then them would write like so these her long make thing see him two has look more day could go come did my sound no most number who over know water than call first people may down side been now find hello world sky blue".split()
    for i, w in enumerate(words):
        add("\u2581" + w, -1.0 - i * 0.01, gguf.TokenType.NORMAL)
        add(w, -2.0 - i * 0.01, gguf.TokenType.NORMAL)
    add("\u2581", -3.0, gguf.TokenType.NORMAL)
    return tokens, scores, types


def main(out):
    rng = np.random.default_rng(7)
    tokens, scores, types = vocab()
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(out, "llama")
    w.add_name("autohedge-tiny-random")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    t("token_embd.weight", n_vocab, N_EMBD)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    t("output.weight", n_vocab, N_EMBD)
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        t(f"blk.{i}.attn_q.weight", N_EMBD, N_EMBD)
        t(f"blk.{i}.attn_k.weight", N_EMBD, N_EMBD)
        t(f"blk.{i}.attn_v.weight", N_EMBD, N_EMBD)
        t(f"blk.{i}.attn_output.weight", N_EMBD, N_EMBD)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        t(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1])
