"""A tiny LLaMA-style tokenizer trained here, and the loader upstream uses for ``--local_tokenizer``.

:func:`train_tiny_tokenizer` trains a sentencepiece BPE model with LLaMA's conventions (``<unk>``=0,
``<s>``=1, ``</s>``=2, byte fallback) and saves it as a ``LlamaTokenizer`` folder (pad ``<unk>``, like vicuna).
:func:`llama2_tokenizer` uses ``<unk>`` as a missing pad token, where upstream's id 32000 would be out of a
small vocabulary.
"""
from __future__ import annotations

import io
import os
import random
import shutil
import string
import tempfile
from typing import Iterable, Optional

import sentencepiece as spm
from transformers import LlamaTokenizer

DEFAULT_ALPHABET = string.digits + string.ascii_lowercase
TEMPLATE_TEXT = [
    "CAPTCHA:", "[INST] CAPTCHA: [/INST] ", "Question: What is the CAPTCHA in image? Short answer: ",
    "Question: CAPTCHA: Answer: ", "This image can be best described as:", "[IMG] [/IMG]",
    "How many characters?", "Where is the text? [[50,100,950,900]]",
]


def _training_sentences(alphabet: str, extra_text: Iterable[str], count: int, seed: int):
    rng = random.Random(seed)
    for i in range(count):
        label = "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 6)))
        yield f"{TEMPLATE_TEXT[i % len(TEMPLATE_TEXT)]} {label}"
    yield from extra_text
    yield " ".join(alphabet) + " " + alphabet.upper()


def train_tiny_tokenizer(directory: str, alphabet: str = DEFAULT_ALPHABET, extra_text: Iterable[str] = (),
                         vocab_size: int = 400, seed: int = 0) -> str:
    """Train and save a LLaMA-style tokenizer in ``directory``; returns ``directory``. The result
    has at most ``vocab_size`` entries (sentencepiece may stop earlier on little text) and needs
    ``vocab_size`` >= 259 + the characters seen, for the 256 byte-fallback pieces."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_training_sentences(alphabet, list(extra_text), 4000, seed), model_writer=model,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, hard_vocab_limit=False, num_threads=1, minloglevel=2)
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory() as staging:
        sp_path = os.path.join(staging, "tokenizer.model")
        with open(sp_path, "wb") as f:
            f.write(model.getvalue())
        tokenizer = LlamaTokenizer.from_pretrained(staging, pad_token="<unk>", legacy=False)
        tokenizer.save_pretrained(directory)
        shutil.copy(sp_path, os.path.join(directory, "tokenizer.model"))
    return directory


def llama2_tokenizer(tokenizer_path: str, signal_type: str = "base"):
    """Load a LLaMA tokenizer the way upstream's ``--local_tokenizer`` does and add its attributes
    (``boi``/``eoi`` "[IMG]"/"[/IMG]", ``signal_type``). A missing pad token becomes ``<unk>``."""
    if signal_type not in ("base", "chat", "vqa", "chat_old"):
        raise ValueError(f"signal_type must be base, chat, vqa or chat_old, not {signal_type!r}")
    tokenizer = LlamaTokenizer.from_pretrained(tokenizer_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.unk_token if tokenizer.unk_token is not None else tokenizer.eos_token
    if not 0 <= tokenizer.pad_token_id < len(tokenizer):
        raise ValueError(f"pad token id {tokenizer.pad_token_id} is outside the vocabulary of {len(tokenizer)}")
    tokenizer.boi = "[IMG]"
    tokenizer.eoi = "[/IMG]"
    tokenizer.signal_type = signal_type
    return tokenizer


def check_vocab(tokenizer, vocab_size: int, pad_token_id: Optional[int] = None) -> None:
    """Refuse a tokenizer whose ids do not fit the model's embedding (``vocab_size``)."""
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name)
        if value is None or not 0 <= value < vocab_size:
            raise ValueError(f"tokenizer {name}={value} does not fit vocab_size {vocab_size}")
    if pad_token_id is not None and pad_token_id != tokenizer.pad_token_id:
        raise ValueError(f"model config pad_token_id {pad_token_id} != tokenizer pad {tokenizer.pad_token_id}")
