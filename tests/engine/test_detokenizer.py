"""Incremental decoding gives, step by step, a prefix of the full decode, and at the end all of it."""

from __future__ import annotations

import random

import pytest
from multiguess.engine.detokenizer import IncrementalText
from multiguess.models.embedded import SHIPPED_DRAFT
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tests.tiny_models import build_tokenizer

TEXT = (
    "Naïve café — déjà vu at 東京タワー 🚀🚀! Ünïcödé   spaces,\n\ttabs and `code()` {x: 1}; "
    "ﬁnal ligature, Ελληνικά, русский, עברית, emoji 👩‍👩‍👧 and done."
)


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE ('▁' marks word starts), whose decode strips a leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "</s>", *bytes_])
    backend.train_from_iterator([TEXT] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


TOKENIZERS = {
    "byte-level BPE (SmolLM2)": lambda: AutoTokenizer.from_pretrained(str(SHIPPED_DRAFT)),
    "metaspace BPE with byte fallback": metaspace_tokenizer,
    "word level": build_tokenizer,
}


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_text_is_always_a_prefix_and_ends_exact(name: str, seed: int) -> None:
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT if name != "word level" else "w1 w2 w3 w4 w5", add_special_tokens=False)
    ids += [rng.randrange(len(tokenizer)) for _ in range(40)]  # arbitrary tokens, special ones too
    state, done, growth = IncrementalText(), 0, 0
    while done < len(ids):
        done = min(len(ids), done + rng.randint(1, 3))
        before = len(state.text)
        text = state.update(tokenizer, ids[:done], final=done == len(ids))
        full = tokenizer.decode(ids[:done], skip_special_tokens=True)
        assert full.startswith(text), (text, full)
        growth += len(text) > before
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert growth > 3  # text arrived along the way, not only at the end
