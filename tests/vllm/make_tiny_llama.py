"""Writes a tiny random-weight Llama (and a BPE tokenizer trained here) that vLLM can serve on CPU.

Usage: make_tiny_llama.py OUT_DIR. Nothing is downloaded: the tokenizer is trained with
`tokenizers` on a few built-in sentences, the weights are random (`transformers`). The head size is
32 (vLLM's CPU attention refuses 16 at the first generation). Run with the vLLM virtualenv's
Python, which has both libraries.
"""
import json
import pathlib
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "AutoHedge routes each request across many backends and fails over on errors.",
    "Hello from the tiny model! It says random things, quickly.",
    "user assistant system tool: what is the weather in Paris today?",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,:;!?'\"()[]{}<>/\\-_=+*&^%$#@",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def main(out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 32
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    print(out)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
