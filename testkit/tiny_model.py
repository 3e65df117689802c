# ruff: noqa: RUF001  (the corpus is multi-byte on purpose: full-width punctuation, Greek)
"""A tiny random Llama checkpoint for tests and benches, built in about a second.

Why this shape (design §10): a wide init (`initializer_range` 0.2, untied embeddings) gives varied,
long output; a byte-level BPE trained on multi-byte text makes tokens that split UTF-8 code points,
which is what the detokenizer, stop-string and equality tests need. EOS's row of the output head
is zeroed so greedy runs do not end early. It is saved with `save_pretrained`, so it loads through
the same `load_model` as a user's checkpoint. Everything is seeded: same files every build.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
VOCAB_SIZE = 600

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "中文分词是一个有趣的问题：字节级的分词器会把汉字拆成几个字节。",
    "Ça va très bien, merci ! Où est la bibliothèque ? Déjà vu, naïve café, crème brûlée.",
    "Größe, Übung, Straße, schön, Fußgänger; año, niño, señor, corazón, acción.",
    "Emoji: 😀 😃 😄 🚀 🌍 🎉 👍 ❤️ 🔥 ✨ — and some arrows → ← ↑ ↓ and math ∑ ∫ √ ∞ ≈ ≠.",
    "日本語のテキストも少し：こんにちは、ありがとう、さようなら。",
    "Русский текст: привет, мир! Ελληνικά: γειά σου κόσμε. العربية: مرحبا",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    'for (let i = 0; i < 10; i++) { console.log(`value: ${i}`); }  // "quotes"',
    "SELECT name, COUNT(*) FROM users WHERE city = 'Zürich' GROUP BY name;",
    "The quick brown fox jumps over the lazy dog. END of story, or is it? The end.",
    "Stop words like STOP, END, and ### sometimes appear in text: <tag>value</tag>.",
)


def _train_tokenizer() -> Tokenizer:
    """Byte-level BPE so merges can cross code-point boundaries inside CJK/emoji runs."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    return tokenizer


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer, with ChatML specials and template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHATML_TEMPLATE,
        model_max_length=1024,
    )


def build_tiny_model(path: Path) -> Path:
    """Write the tiny checkpoint (config, safetensors, tokenizer) to `path` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
        eos_token_id=eos_id,
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight[eos_id].zero_()
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
