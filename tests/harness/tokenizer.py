"""A Hugging Face tokenizer made on the spot, for tests: no download."""

from __future__ import annotations

from pathlib import Path

SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "a lazy dog sleeps in the sun all day",
    "the fox and the dog are friends now",
    "every day the sun rises over the quiet hills",
)


def train_bpe(path: "str | Path", texts=SENTENCES, vocab: int = 300):
    """A byte-level BPE tokenizer trained on ``texts`` with the ``tokenizers`` library, saved
    as ``path/tokenizer.json`` (as a Hugging Face model directory holds it); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        list(texts),
        trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(path) / "tokenizer.json"))
    return tok


def corpus(path: "str | Path", n: int = 200) -> Path:
    """A text file of ``n`` of the sentences, repeated: enough tokens for tiny runs."""
    f = Path(path)
    f.write_text(" ".join(SENTENCES[i % len(SENTENCES)] for i in range(n)), encoding="utf-8")
    return f
