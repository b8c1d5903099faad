"""`text`: labelled text from one folder per class of `.txt` files (one example per
file) or from a CSV/TSV file with a text and a label column.

The split is seeded; the tokenizer is Keras' `TextVectorization` (word or character
n-grams) fitted on the training split only (its vocabulary is deterministic: tokens by
count, ties broken by the token); `char_ngrams: N` adds the text's character 2- to
N-grams as tokens of their own after the words (fastText's subword features: the
recipe's embedding bag then sees what TF-IDF of words and character n-grams sees). Examples are token ids, so training runs on integer
tensors on any device; the exported SavedModel puts the fitted tokenizer in front of
the model and takes raw strings (`InputSpec.serving`); TFLite files take token ids.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError
from tftrain.data.arrays import from_arrays
from tftrain.data.source import (DATASETS, IndexedSource, Serving, TokenStatistics, existing,
                                  options)
from tftrain.core.keras import keras

TABLE_SUFFIXES = {".csv": ",", ".tsv": "\t"}
CHAR_ANALYZERS = {"char": "character", "char_wb": "char_wb"}   # option -> tokenizer's tokens


def read_folder(root: Path, on_bad_record: str):
    """(texts, labels, classes) of root/<class>/<file>.txt."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise ConfigError(f"data.params.path: {root} has no class sub-folders (expected "
                          "root/<class>/<file>.txt), and is not a .csv/.tsv file")
    texts, labels = [], []
    for label, name in enumerate(classes):
        found = sorted((root / name).glob("*.txt"))
        if not found:
            raise ConfigError(f"data.params.path: class folder {root / name} has no .txt files; "
                              "remove it or add texts")
        for f in found:
            text = _decode(f.read_bytes(), f, on_bad_record)
            if text is None:
                continue
            texts.append(text)
            labels.append(label)
    return texts, np.array(labels, np.int32), classes


def _decode(data: bytes, where, on_bad_record: str) -> Optional[str]:
    try:
        text = data.decode("utf-8").strip()
        problem = "is empty" if not text else None
    except UnicodeDecodeError as err:
        text, problem = None, f"is not UTF-8 text ({err.reason} at byte {err.start})"
    if problem is None:
        return text
    if on_bad_record == "fail":
        raise ConfigError(f"data: {where} {problem}; fix or remove it, or set "
                          "data.on_bad_record: skip")
    return None


def read_table(path: Path, text_column: str, label_column: str, on_bad_record: str):
    """(texts, labels, classes) of a CSV/TSV file with a header row."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter=TABLE_SUFFIXES[path.suffix.lower()]))
    except UnicodeDecodeError as err:
        raise ConfigError(f"data.params.path: {path} is not UTF-8 text ({err.reason}); save it "
                          "as UTF-8") from None
    if not rows:
        raise ConfigError(f"data.params.path: {path} is empty; expected a header row with "
                          f"'{text_column}' and '{label_column}' columns")
    header = rows[0]
    for key, column in (("text_column", text_column), ("label_column", label_column)):
        if column not in header:
            raise ConfigError(f"data.params.{key}: column '{column}' is not in {path} (its "
                              f"columns are: {', '.join(header)})")
    ti, li = header.index(text_column), header.index(label_column)
    texts, names = [], []
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            if on_bad_record == "fail":
                raise ConfigError(f"data: {path}:{line} has {len(row)} fields, the header has "
                                  f"{len(header)}; fix the row or set data.on_bad_record: skip")
            continue
        text = _decode(row[ti].encode(), f"{path}:{line}: the text", on_bad_record)
        label = row[li].strip()
        if text is None:
            continue
        if not label:
            if on_bad_record == "fail":
                raise ConfigError(f"data: {path}:{line} has no label; fix the row or set "
                                  "data.on_bad_record: skip")
            continue
        texts.append(text)
        names.append(label)
    classes = sorted(set(names))
    index = {c: i for i, c in enumerate(classes)}
    return texts, np.array([index[n] for n in names], np.int32), classes


def split(root: Path, fraction: float, seed: int, text_column: str = "text",
          label_column: str = "label", on_bad_record: str = "fail"):
    """((train texts, labels), (validation texts, labels), classes): the seeded split
    the `text` source trains on (baselines use it too)."""
    if root.is_dir():
        texts, labels, classes = read_folder(root, on_bad_record)
    elif root.suffix.lower() in TABLE_SUFFIXES:
        texts, labels, classes = read_table(root, text_column, label_column, on_bad_record)
    else:
        raise ConfigError(f"data.params.path: {root} is neither a folder of class folders nor "
                          "a .csv/.tsv file")
    if len(texts) < 2:
        raise ConfigError(f"data.params.path: {root} holds {len(texts)} texts; need at least 2")
    order = np.random.default_rng(seed).permutation(len(texts))
    n_val = int(round(len(texts) * fraction))
    train, val = order[n_val:], order[:n_val]
    return (([texts[i] for i in train], labels[train]), ([texts[i] for i in val], labels[val]),
            classes)


@keras.utils.register_keras_serializable("tftrain")
class WordBoundedGrams:
    """A `TextVectorization` split: each word's character n-grams (n in `sizes`) with the
    word padded by a space on each side, so no n-gram spans two words (scikit-learn's
    `char_wb` analyzer: a padded word is at least 3 characters, so the 2-grams cover
    every word)."""

    def __init__(self, sizes):
        self.sizes = tuple(int(n) for n in sizes)

    def __call__(self, texts):
        words = tf.strings.split(texts)                                  # [batch, (words)]
        padded = tf.strings.join([" ", words.flat_values, " "])
        chars = tf.strings.unicode_split(padded, "UTF-8")                # [words, (chars)]
        grams = [tf.strings.ngrams(chars, n, separator="") for n in self.sizes]
        per_word = tf.concat(grams, axis=1)                              # [words, (grams)]
        return tf.RaggedTensor.from_row_splits(per_word.values,
                                               tf.gather(per_word.row_splits,
                                                         words.row_splits))

    def get_config(self):
        return {"sizes": list(self.sizes)}


def tokenizer(tokens: str, ngrams, vocab_size: int, sequence_length: Optional[int]):
    """`TextVectorization` over words or characters (n-grams up to `ngrams`, or the
    sizes a tuple names); `tokens: char_wb`: character n-grams within words
    (`WordBoundedGrams`)."""
    if tokens == "char_wb" and isinstance(ngrams, tuple):
        return keras.layers.TextVectorization(
            max_tokens=vocab_size, standardize="lower_and_strip_punctuation",
            split=WordBoundedGrams(ngrams), output_mode="int",
            output_sequence_length=sequence_length, name="tokenizer")
    if tokens not in ("word", "character"):
        raise ConfigError(f"data.params.tokens: {tokens!r}; expected word or character")
    if isinstance(ngrams, int) and not 1 <= ngrams <= 5:
        raise ConfigError(f"data.params.ngrams: {ngrams}; expected 1 to 5 (n-grams up to n)")
    return keras.layers.TextVectorization(
        max_tokens=vocab_size, standardize="lower_and_strip_punctuation",
        split="whitespace" if tokens == "word" else "character",
        ngrams=None if ngrams == 1 else ngrams, output_mode="int",
        output_sequence_length=sequence_length, name="tokenizer")


class Tokenizers(keras.layers.Layer):
    """Several fitted tokenizers as one: each text's ids from each, side by side, each
    tokenizer's ids shifted past the vocabularies before it (padding stays 0)."""

    def __init__(self, parts, **kwargs):
        super().__init__(**kwargs)
        self.parts = list(parts)
        sizes = [part.vocabulary_size() for part in self.parts]
        self.offsets = [int(o) for o in np.cumsum([0, *sizes[:-1]])]

    def call(self, texts):
        rows = []
        for part, offset in zip(self.parts, self.offsets):
            ids = tf.cast(part(texts), tf.int32)
            rows.append(tf.where(ids > 0, ids + offset, tf.zeros_like(ids)))
        return tf.concat(rows, axis=-1)

    def vocabulary_size(self) -> int:
        return sum(part.vocabulary_size() for part in self.parts)

    def get_vocabulary(self) -> list[str]:
        """Every id's token (a character n-gram's written `chars:<n-gram>`)."""
        words, *rest = [part.get_vocabulary() for part in self.parts]
        return words + [f"chars:{token}" for vocabulary in rest for token in vocabulary]


def document_frequency(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """How many rows of `ids` hold each id (padding's 0 counted as none)."""
    ordered = np.sort(ids, axis=1)
    first = np.ones_like(ordered, dtype=bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    counts = np.bincount(ordered[first], minlength=vocab_size).astype(np.float32)
    counts[0] = 0.0
    return counts


def encode(layer, texts: list[str]) -> np.ndarray:
    return np.concatenate([layer(tf.constant(texts[i:i + 512])).numpy()
                           for i in range(0, len(texts), 512)]).astype(np.int32)


@dataclass(frozen=True)
class TextOptions:
    """`data.params` of `text` (`on_bad_record`: `data.on_bad_record`)."""
    path: str = ""
    text_column: str = "text"
    label_column: str = "label"
    tokens: str = "word"
    ngrams: int = 1
    vocab_size: int = 20000
    sequence_length: Optional[int] = None
    char_ngrams: int = 0
    char_vocab_size: Optional[int] = 30000
    char_analyzer: str = "char"
    on_bad_record: str = "fail"


def fitted(spec: tuple, texts: list[str], sequence_length: Optional[int]):
    """A tokenizer (`spec`: tokens, n-grams, vocabulary size) fitted on `texts`, padding
    or cutting to `sequence_length` tokens (None: the 95th percentile of their lengths,
    rounded up to a multiple of 8); (the tokenizer, its length)."""
    tokens, ngrams, vocab_size = spec
    layer = tokenizer(tokens, ngrams, vocab_size, None)
    layer.adapt(tf.data.Dataset.from_tensor_slices(texts).batch(512))
    if sequence_length is None:
        lengths = np.concatenate([np.count_nonzero(layer(tf.constant(texts[i:i + 512])).numpy(),
                                                   axis=1) for i in range(0, len(texts), 512)])
        sequence_length = int(np.ceil(np.percentile(lengths, 95) / 8) * 8) or 8
    fixed = tokenizer(tokens, ngrams, vocab_size, int(sequence_length))
    fixed.set_vocabulary(layer.get_vocabulary())
    return fixed, int(sequence_length)


@DATASETS.register("text")
@options(TextOptions)
def text(fraction: float, seed: int, o: TextOptions = TextOptions()) -> IndexedSource:
    """Text classification: a folder per class of .txt files, or a .csv/.tsv file;
    tokenized by `TextVectorization` fitted on the training split (`tokens`: word or
    character, n-grams up to `ngrams`, the `vocab_size` most frequent, padded or cut to
    `sequence_length` tokens: by default the 95th percentile of training lengths), and
    with `char_ngrams` the character 2- to N-grams after them (the `char_vocab_size` most
    frequent, as many as `sequence_length` or by default their 95th percentile)."""
    path, text_column, label_column, on_bad_record = (o.path, o.text_column, o.label_column,
                                                      o.on_bad_record)
    tokens, ngrams, vocab_size, sequence_length = o.tokens, o.ngrams, o.vocab_size, o.sequence_length
    root = existing(path, "data.params.path")
    (train_texts, y_train), (val_texts, y_val), classes = split(
        root, fraction, seed, text_column, label_column, on_bad_record)
    if o.char_ngrams and not 2 <= o.char_ngrams <= 6:
        raise ConfigError(f"data.params.char_ngrams: {o.char_ngrams}; expected 0 (none) or 2 "
                          "to 6 (character 2- to N-grams beside the words)")
    if o.char_analyzer not in CHAR_ANALYZERS:
        raise ConfigError(f"data.params.char_analyzer: {o.char_analyzer!r}; expected char "
                          "(n-grams across the text) or char_wb (within words)")
    specs = [(tokens, ngrams, vocab_size)] + (
        [(CHAR_ANALYZERS[o.char_analyzer], tuple(range(2, o.char_ngrams + 1)),
          o.char_vocab_size)] if o.char_ngrams else [])
    parts, lengths = zip(*[fitted(part, train_texts, sequence_length) for part in specs])
    fixed = parts[0] if len(parts) == 1 else Tokenizers(parts, name="tokenizer")
    sequence_length = sum(lengths)
    x_train = encode(fixed, train_texts)
    source = from_arrays(x_train, y_train, fraction, seed,
                         num_classes=len(classes), vocab_size=fixed.vocabulary_size(),
                         validation=(encode(fixed, val_texts) if val_texts else
                                     np.zeros((0, sequence_length), np.int32), y_val),
                         where=f"data.params.path: {root}")
    serving = Serving(fixed, ((), "string"), np.array(val_texts, dtype=object), "raw strings")
    groups = tuple(fixed.offsets) if len(parts) > 1 else (0,)
    statistics = TokenStatistics(groups, len(train_texts),
                                 document_frequency(x_train, fixed.vocabulary_size()))
    spec = source.spec.__class__(**{**source.spec.__dict__, "serving": serving,
                                    "tokens": statistics})
    kind = (f"{len(train_texts) + len(val_texts)} texts under {root}, {len(classes)} classes; {tokens} "
            f"{ngrams}-grams" + (f" and character 2- to {o.char_ngrams}-grams"
                                 if o.char_ngrams else "")
            + f", vocabulary {fixed.vocabulary_size()}, {sequence_length} tokens")
    return IndexedSource(spec, source.num_train, source.num_val, source.load, source.val,
                         kind=kind, decoded_bytes=source.decoded_bytes)
