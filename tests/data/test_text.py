"""The `text` source (folders and CSV/TSV, tokenizer fitted on training texts only, bad
files), the embedding-bag model, and the exported SavedModel answering raw strings."""
import json
import re

import numpy as np
import pytest
import tensorflow as tf

from tftrain.config import load_config
from tftrain.data import load_source
from tftrain.data.text import split
from tftrain.export.artifacts import tflite_weights
from tftrain.run import main

from helpers import QUICKSTART, quick_config, saved_model_cli

WORDS = {"space": "rocket orbit planet star moon launch", "food": "bread cheese soup apple cook bake"}


def make_texts(root, n=12):
    rng = np.random.default_rng(0)
    rows = []
    for label, words in WORDS.items():
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            text = " ".join(rng.choice(words.split(), 6)) + f" unique{label}{i}"
            (root / label / f"{i:03d}.txt").write_text(text.capitalize() + ".\n")
            rows.append((text, label))
    return rows


def cfg(path, *sets):
    return load_config(None, ["data.name=text", f"data.params={{path: {path}}}", *sets])


def test_folder_and_tsv_give_the_same_split_and_a_vocabulary_of_training_texts_only(tmp_path):
    rows = make_texts(tmp_path / "texts")
    table = tmp_path / "texts.tsv"
    rows = sorted(rows, key=lambda r: r[1])          # the folders' order: the same split
    table.write_text("label\ttext\n" + "".join(f"{label}\t{text.capitalize()}.\n" for text, label in rows))
    a = load_source(cfg(tmp_path / "texts", "data.validation_fraction=0.25").data, 5)
    b = load_source(cfg(table, "data.validation_fraction=0.25").data, 5)
    (train, _), (val, yv), classes = split(tmp_path / "texts", 0.25, 5)
    assert classes == ["food", "space"] and len(val) == 6 and a.num_val == 6 and b.num_train == 18
    vocab = set(a.spec.serving.layer.get_vocabulary())
    train_words = {w.strip(".").lower() for t in train for w in t.split()}
    val_only = {w.strip(".").lower() for t in val for w in t.split()} - train_words
    assert val_only and not vocab & val_only                     # fitted on training texts only
    assert vocab - {"", "[UNK]"} <= train_words
    assert set(b.spec.serving.layer.get_vocabulary()) == vocab
    xa = np.concatenate([x.numpy() for x, _ in a.validation().batch(8)])
    xb = np.concatenate([x.numpy() for x, _ in b.validation().batch(8)])
    np.testing.assert_array_equal(xa, xb)
    assert list(a.spec.serving.validation) == val and a.spec.dtype == "int32"
    ids = a.spec.serving.layer(tf.constant(["rocket bread nonsenseword"])).numpy()[0]
    assert ids[2] == 1 and ids[0] > 1 and ids[1] > 1 and not ids[3:].any()   # OOV -> 1, padded


def test_character_ngrams_come_after_the_words_with_their_own_vocabulary(tmp_path):
    make_texts(tmp_path / "texts")
    words = load_source(cfg(tmp_path / "texts", "data.validation_fraction=0.25").data, 5)
    both = load_source(cfg(tmp_path / "texts", "data.validation_fraction=0.25",
                           "data.params.char_ngrams=3").data, 5)
    layer = both.spec.serving.layer
    vocab = layer.get_vocabulary()
    word_vocab = words.spec.serving.layer.get_vocabulary()
    assert vocab[:len(word_vocab)] == word_vocab
    grams = [t[len("chars:"):] for t in vocab[len(word_vocab):]]
    assert grams[:2] == ["", "[UNK]"] and both.spec.vocab_size == len(vocab)
    # character 2- and 3-grams only (TextVectorization joins a gram's n characters by
    # spaces: 2n - 1 characters)
    assert {len(g) for g in grams[2:]} == {3, 5}
    (train, _), _, _ = split(tmp_path / "texts", 0.25, 5)
    seen = {" ".join(t.lower().strip(".")[i:i + n]) for t in train for n in (2, 3)
            for i in range(len(t) - n)}
    assert set(grams[2:]) <= seen                          # fitted on training texts only
    n_words = words.spec.shape[0]
    ids = layer(tf.constant(["rocket moon"])).numpy()[0]
    np.testing.assert_array_equal(ids[:n_words],
                                  words.spec.serving.layer(tf.constant(["rocket moon"])).numpy()[0])
    chars = ids[n_words:]
    # "rocket moon": 10 2-grams and 9 3-grams, each shifted past the word vocabulary
    assert np.count_nonzero(chars) == 19 and (chars[chars > 0] >= len(word_vocab)).all()
    assert [vocab[i] for i in chars[:2]] == ["chars:r o", "chars:o c"]
    xv = np.concatenate([x.numpy() for x, _ in both.validation().batch(8)])
    np.testing.assert_array_equal(xv, layer(tf.constant(list(both.spec.serving.validation))).numpy())


def test_character_ngrams_within_words_are_scikit_learns_char_wb_and_counted(tmp_path):
    """`char_analyzer: char_wb`: each training text's n-gram ids are exactly the ids of
    scikit-learn's `char_wb` n-grams of it; the spec carries each id's document frequency
    over the training texts and where the n-grams' ids start."""
    from sklearn.feature_extraction.text import CountVectorizer

    make_texts(tmp_path / "texts")
    src = load_source(cfg(tmp_path / "texts", "data.validation_fraction=0.25",
                          "data.params.char_ngrams=4", "data.params.char_analyzer=char_wb",
                          "data.params.char_vocab_size=null").data, 5)
    layer, stats = src.spec.serving.layer, src.spec.tokens
    vocab = layer.get_vocabulary()
    start = stats.groups[1]
    assert stats.groups == (0, layer.parts[0].vocabulary_size()) and vocab[start:start + 2] == [
        "chars:", "chars:[UNK]"]
    analyzer = CountVectorizer(analyzer="char_wb", ngram_range=(2, 4)).build_analyzer()
    (train, _), _, _ = split(tmp_path / "texts", 0.25, 5)
    x, _ = src.load(tf.range(src.num_train))
    for text, ids in zip(train, x.numpy()):
        grams = {vocab[i][len("chars:"):] for i in ids if i >= start + 2}
        assert grams == set(analyzer(re.sub(r"[^\w\s]", "", text.lower())))
    holding = (x.numpy()[:, :, None] == np.arange(len(vocab))).any(axis=1).sum(axis=0)
    holding[0] = 0
    np.testing.assert_array_equal(stats.frequency, holding)
    assert stats.documents == src.num_train


@pytest.mark.parametrize("case,pattern", [
    ("empty_file", r"data: .*space/003\.txt is empty; fix or remove it, or set data\.on_bad_record: skip"),
    ("empty_folder", r"class folder .*sport has no \.txt files"),
    ("no_label_column", r"data\.params\.label_column: column 'label' is not in .*t\.csv \(its columns are: text, category\)"),
    ("no_label", r"data: .*t\.csv:3 has no label"),
    ("char_ngrams", r"data\.params\.char_ngrams: 9; expected 0 \(none\) or 2 to 6"),
    ("char_analyzer", r"data\.params\.char_analyzer: 'chars'; expected char \(n-grams across "
                      r"the text\) or char_wb \(within words\)"),
])
def test_bad_text_exits_2_naming_the_file_or_key(tmp_path, capsys, case, pattern):
    make_texts(tmp_path / "texts")
    path = tmp_path / "texts"
    if case == "empty_file":
        (path / "space" / "003.txt").write_text("  \n")
    if case == "empty_folder":
        (path / "sport").mkdir()
    if case == "no_label_column":
        path = tmp_path / "t.csv"
        path.write_text("text,category\nhello world,a\n")
    if case == "no_label":
        path = tmp_path / "t.csv"
        path.write_text("text,label\nhello world,a\nbye world,\n")
    runs = tmp_path / "runs"
    sets = ["data.name=text", f"data.params={{path: {path}}}", "model={name: embedding_bag}",
            *(["data.params.char_ngrams=9"] if case == "char_ngrams" else []),
            *(["data.params={path: " + str(path) + ", char_ngrams: 3, char_analyzer: chars}"]
              if case == "char_analyzer" else [])]
    assert main([str(QUICKSTART), "--run-dir", str(runs), *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert "Traceback" not in err and not runs.exists()


@pytest.mark.slow
def test_text_run_exports_a_saved_model_that_answers_raw_strings(tmp_path, fortunes):
    """... and an int8 embedding table in each int8 artifact (QAT quantizes the table):
    the TFLite file, the int8 SavedModel and the int8 ONNX model hold its int8 codes."""
    from tftrain.run import run
    summary = run(quick_config(tmp_path, "data.name=text", f"data.params={{path: {fortunes}}}",
                               "model={name: embedding_bag, params: {embed_dim: 16}}",
                               "train.epochs=4", "run.name=text", "export.tflite=int8",
                               "export.saved_model_int8=true", "export.onnx=true",
                               "compression.quantization={enabled: true, epochs: 1, skip_unsupported: true}"))
    art = summary["artifacts"]
    export = tmp_path / "text" / "export"
    vocabulary = len((export / "vocabulary.txt").read_text().splitlines())
    table = (vocabulary, 16)
    # TFLite: the table int8, and nearly every weight byte with it
    weights = tflite_weights((export / "model.tflite").read_bytes(), min_size=1)
    assert [w.dtype for w in weights.values() if w.shape == table] == [np.int8]
    assert sum(w.nbytes for w in weights.values() if w.dtype == np.int8) >= \
        0.95 * sum(w.nbytes for w in weights.values())
    # the int8 SavedModel: the table as int8 codes and a scale, no float table
    reader = tf.train.load_checkpoint(str(export / "saved_model_int8" / "variables" / "variables"))
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    assert [dtypes[k] for k in shapes if tuple(shapes[k]) == table] == [tf.int8]
    # the int8 ONNX model: the table an int8 initializer
    import onnx
    from onnx import numpy_helper
    graph = onnx.load(str(export / "model_int8.onnx")).graph
    assert [numpy_helper.to_array(i).dtype for i in graph.initializer
            if tuple(i.dims) == table] == [np.int8]
    assert art["tflite_int8"]["accuracy"] >= summary["stages"]["train"]["metrics"]["val_accuracy"] - 0.01
    assert summary["metrics"]["val_accuracy"] > 0.75               # 2 classes, 1,255 fortunes
    assert art["saved_model"]["input"] == "raw strings" and art["saved_model"]["verified"]
    assert art["tflite_int8"]["input"].startswith("int32 [") and art["tflite_int8"]["verified"]
    assert (export / "vocabulary.txt").read_text().splitlines()[:2] == ["", "[UNK]"]
    texts = ["Lawyers and judges argue a case in court.", "The compiler crashed the kernel again."]
    out = saved_model_cli("run", "--dir", export / "saved_model", "--tag_set", "serve",
                          "--signature_def", "serving_default", "--input_exprs",
                          f"inputs={json.dumps(texts)}")
    assert out.returncode == 0, out.stderr[-2000:]
    printed = re.search(r"Result for output key logits:\s*(\[\[.*?\]\])", out.stdout, re.S).group(1)
    logits = np.array(json.loads(re.sub(r"\s+", ",", printed.replace("[ ", "[")).replace(",]", "]")
                                 .replace("[,", "[")))
    loaded = tf.saved_model.load(str(export / "saved_model")).signatures["serving_default"]
    np.testing.assert_allclose(logits, loaded(inputs=tf.constant(texts))["logits"].numpy(), atol=1e-4)
