"""GLUE readers (original TSV layout, datasets fallback), offline tokenizer, tokenising, loader."""

from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from dgpipe.data.glue import glue_task, load_glue, make_glue_loader, read_glue_tsv, tokenize_glue
from dgpipe.data.tokenizer import offline_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "glue"
REAL = Path("/work/shared/data/glue")


def test_rte_string_labels():
    train = load_glue("rte", FIXTURES, "train")
    assert len(train) == 4
    assert train[0] == (
        "No Weapons of Mass Destruction Found in Iraq Yet.",
        "Weapons of Mass Destruction Found in Iraq.",
        1,  # not_entailment
    )
    assert [y for _, _, y in train] == [1, 0, 0, 0]  # not_entailment, then entailment x3
    assert [y for _, _, y in load_glue("rte", FIXTURES, "validation")] == [1, 0, 1, 1]


def test_cola_has_no_header():
    train = load_glue("cola", FIXTURES, "train")
    assert len(train) == 6  # every line is data
    assert train[0] == ("Our friends won't buy this analysis, let alone the next one we propose.", None, 1)
    assert train[-1] == ("The professor talked us.", None, 0)
    dev = load_glue("CoLA", FIXTURES, "dev")  # last line without newline, as in the real file
    assert dev[-1][0].endswith("less.") and len(dev) == 4


def test_sst2_and_mrpc():
    sst = load_glue("sst-2", FIXTURES, "train")
    assert sst[0] == ("hide new secretions from the parental units ", None, 0)
    assert [y for _, _, y in sst] == [0, 0, 1, 0]
    mrpc = load_glue("mrpc", FIXTURES, "train")  # BOM + header "Quality #1 ID #2 ID #1 String #2 String"
    a, b, y = mrpc[0]
    assert a.startswith('Amrozi accused his brother , whom he called " the witness "') and y == 1
    assert b.startswith('Referring to him as only " the witness "')  # bare quotes kept as text
    assert [y for _, _, y in mrpc] == [1, 0, 1, 0]


def test_stsb_and_mnli_layouts():
    stsb = load_glue("stsb", FIXTURES, "dev")
    assert stsb[1] == ("A man is playing a large flute.", "A man is playing a flute.", 3.8)
    assert glue_task("stsb").num_labels == 1 and glue_task("mnli").num_labels == 3
    mnli = load_glue("mnli", FIXTURES, "validation_matched")  # dev_matched.tsv
    assert [(a[:9], y) for a, _, y in mnli] == [("The new r", 1), ("This site", 2)]  # neutral, contradiction
    with pytest.raises(FileNotFoundError, match="dev_mismatched.tsv"):
        load_glue("mnli", FIXTURES, "dev_mismatched")


def test_task_folder_itself_works():
    assert load_glue("rte", FIXTURES / "RTE", "train") == load_glue("rte", FIXTURES, "train")


def test_bad_input_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown GLUE task"):
        load_glue("imdb", FIXTURES, "train")
    with pytest.raises(ValueError, match="no labelled split 'test'"):
        load_glue("rte", FIXTURES, "test")
    with pytest.raises(FileNotFoundError, match=r"QQP/train.tsv.*--data-dir"):
        load_glue("qqp", FIXTURES, "train")
    bad = tmp_path / "RTE"
    bad.mkdir()
    (bad / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\n")
    with pytest.raises(ValueError, match=r"train.tsv:3: expected 4 tab-separated fields, got 3"):
        read_glue_tsv("rte", bad / "train.tsv")
    (bad / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    with pytest.raises(ValueError, match=r"train.tsv:2: label 'maybe'"):
        read_glue_tsv("rte", bad / "train.tsv")
    (bad / "train.tsv").write_text("sentence\tlabel\nx\t1\n")
    with pytest.raises(ValueError, match="lacks a column"):
        read_glue_tsv("rte", bad / "train.tsv")


def test_datasets_fallback(monkeypatch):
    calls = []

    def fake_load(path, name, split):
        calls.append((path, name, split))
        return datasets.Dataset.from_dict({"premise": ["p1", "p2"], "hypothesis": ["h1", "h2"], "label": [2, 0]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert load_glue("mnli", None, "dev") == [("p1", "h1", 2), ("p2", "h2", 0)]
    assert calls == [("nyu-mll/glue", "mnli", "validation_matched")]

    def offline(*args, **kwargs):
        raise ConnectionError("no internet")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match=r"load_dataset\('nyu-mll/glue', 'rte'\) failed.*--data-dir"):
        load_glue("rte", None, "train")


def test_subset_is_fixed_and_stratified():
    full = load_glue("cola", FIXTURES, "train")
    sub = load_glue("cola", FIXTURES, "train", subset=3, seed=5)
    assert sub == load_glue("cola", FIXTURES, "train", subset=3, seed=5)
    assert all(s in full for s in sub) and sorted(y for _, _, y in sub) == [0, 1, 1]  # 2:4 classes -> 1:2
    with pytest.raises(ValueError, match="split has 6 examples"):
        load_glue("cola", FIXTURES, "train", subset=7)


@pytest.fixture(scope="module")
def tokenizer():
    examples = [ex for task in ("rte", "mrpc", "sst2", "cola") for ex in load_glue(task, FIXTURES, "train")]
    texts = [t for ex in examples for t in ex[:2] if t]
    return offline_tokenizer(texts, vocab_size=300)


def test_offline_tokenizer(tokenizer):
    assert tokenizer.pad_token_id == 0 and tokenizer.cls_token_id == 2 and tokenizer.sep_token_id == 3
    enc = tokenizer("the witness", "his evidence")
    assert "token_type_ids" not in enc
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"])
    assert tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2 and tokens[-1] == "[SEP]"
    assert tokenizer.decode(enc["input_ids"], skip_special_tokens=True) == "the witness his evidence"
    bert_like = offline_tokenizer(["a b c", "b c d"], vocab_size=50, token_type_ids=True)
    enc = bert_like("a b", "c")
    assert enc["token_type_ids"] == [0, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="non-empty"):
        offline_tokenizer([])


def test_offline_tokenizer_vocabulary_is_deterministic():
    texts = ["the cat sat", "the cat ran", "a dog sat", "Über alles"]
    tok = offline_tokenizer(texts, vocab_size=5 + 2 * 14 + 2)  # specials, 14 chars twice, 2 words
    assert tok.get_vocab() == offline_tokenizer(list(texts), vocab_size=35).get_vocab()
    assert len(tok) == 35
    # most frequent words first: "the", "cat", "sat" occur twice; ties alphabetical -> cat, sat
    assert tok.tokenize("cat sat the") == ["cat", "sat", "t", "##h", "##e"]
    assert tok.tokenize("über ?") == ["u", "##b", "##e", "##r", "[UNK]"]  # accents stripped; "?" never seen


def test_tokenize_glue_pairs_and_single(tokenizer):
    rte = load_glue("rte", FIXTURES, "train")
    enc = tokenize_glue(rte, tokenizer, max_length=24)
    assert set(enc) == {"input_ids", "attention_mask", "labels"}
    assert enc["input_ids"].shape == (4, 24) and enc["input_ids"].dtype == torch.int64
    assert enc["attention_mask"].dtype == torch.int64 and enc["labels"].tolist() == [y for _, _, y in rte]
    for ids, mask, (a, b, _) in zip(enc["input_ids"], enc["attention_mask"], rte):
        full = tokenizer(a, b)["input_ids"]
        n = int(mask.sum())
        assert n == min(len(full), 24) and (ids[n:] == tokenizer.pad_token_id).all() and (mask[:n] == 1).all()
        assert ids[0] == tokenizer.cls_token_id and ids[n - 1] == tokenizer.sep_token_id
        assert (ids[:n] == tokenizer.sep_token_id).sum() == 2  # both texts survive truncation
    sst = tokenize_glue(load_glue("sst2", FIXTURES, "train"), tokenizer, max_length=8)
    n = sst["attention_mask"].sum(1)
    assert ((sst["input_ids"] == tokenizer.sep_token_id).sum(1) == 1).all() and (n <= 8).all()
    stsb = tokenize_glue(load_glue("stsb", FIXTURES, "dev"), tokenizer, max_length=16)
    assert stsb["labels"].dtype == torch.float32 and stsb["labels"].tolist() == pytest.approx([5.0, 3.8, 3.8])


def test_make_glue_loader(tokenizer):
    loader = make_glue_loader("mrpc", tokenizer, FIXTURES, "train", batch_size=2, max_length=16, seed=0)
    batches = list(loader)
    assert len(batches) == 2
    (ids, mask), labels = batches[0]
    assert ids.shape == mask.shape == (2, 16) and labels.shape == (2,) and labels.dtype == torch.int64
    again = list(make_glue_loader("mrpc", tokenizer, FIXTURES, "train", batch_size=2, max_length=16, seed=0))
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(batches, again))
    dev = list(make_glue_loader("mrpc", tokenizer, FIXTURES, "dev", batch_size=3, max_length=16))
    assert [len(lab) for _, lab in dev] == [3, 1]  # in order, nothing dropped
    assert torch.cat([lab for _, lab in dev]).tolist() == [1, 0, 0, 1]


def test_padding_to_the_longest_example_matches_the_tokenizer(tokenizer):
    """pad_to_longest cuts each batch to its longest example: the tokenizer's own
    padding="longest" on the same examples, and the same rows up to that length."""
    loader = make_glue_loader("cola", tokenizer, FIXTURES, "dev", batch_size=3, max_length=64, pad_to_longest=True)
    full = make_glue_loader("cola", tokenizer, FIXTURES, "dev", batch_size=3, max_length=64)
    dev = load_glue("cola", FIXTURES, "dev")
    start = 0
    for ((ids, mask), labels), ((ids64, mask64), _) in zip(loader, full):
        batch = dev[start : start + len(labels)]
        start += len(labels)
        ref = tokenizer([a for a, _, _ in batch], padding="longest", truncation=True, max_length=64, return_tensors="pt")
        assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])
        assert ids64.shape[1] == 64 and torch.equal(ids64[:, : ids.shape[1]], ids) and not mask64[:, ids.shape[1]:].any()
    assert start == len(dev)


@pytest.mark.skipif(not REAL.is_dir(), reason=f"real GLUE TSVs not present at {REAL}")
@pytest.mark.parametrize(
    "task,train,dev,train_counts",
    [("rte", 2490, 277, [1249, 1241]), ("cola", 8551, 1043, [2528, 6023]), ("sst2", 67349, 872, [29780, 37569]),
     ("mrpc", 3668, 408, [1194, 2474])],
)
def test_real_glue_files(task, train, dev, train_counts):
    examples = load_glue(task, REAL, "train")
    assert len(examples) == train and len(load_glue(task, REAL, "dev")) == dev
    assert np.bincount([y for _, _, y in examples]).tolist() == train_counts  # counts from shared/data/README.md


REAL_GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"


@pytest.mark.skipif(not (REAL_GLUE / "SST-2" / "train.tsv").is_file(), reason=f"needs {REAL_GLUE}")
def test_heldout_is_fixed_disjoint_from_training_and_stratified():
    full = load_glue("sst2", REAL_GLUE, "train")
    held = load_glue("sst2", REAL_GLUE, "heldout", heldout=4000)
    rest = load_glue("sst2", REAL_GLUE, "train", heldout=4000)
    assert len(held) == 4000 and len(rest) == len(full) - 4000
    key = lambda ex: (ex[0], ex[2])  # noqa: E731
    assert sorted(map(key, held + rest)) == sorted(map(key, full))  # a partition of the file
    # the training subsets of every seed come from the rest only (as multisets: SST-2 repeats
    # some phrases); the held-out set does not move with them
    rest_count = Counter(map(key, rest))
    for seed in (0, 1, 2):
        sub = load_glue("sst2", REAL_GLUE, "train", subset=2000, seed=seed, heldout=4000)
        assert len(sub) == 2000 and not Counter(map(key, sub)) - rest_count
    assert load_glue("sst2", REAL_GLUE, "heldout", heldout=4000, seed=5) == held
    share = sum(y for _, _, y in held) / len(held)  # class-stratified: the file's share of positives
    assert share == pytest.approx(sum(y for _, _, y in full) / len(full), abs=1e-3)


def test_heldout_bad_values():
    with pytest.raises(ValueError, match="split 'heldout' needs heldout >= 1"):
        load_glue("sst2", FIXTURES, "heldout")
    with pytest.raises(ValueError, match="heldout must be >= 0, got -1"):
        load_glue("sst2", FIXTURES, "train", heldout=-1)
    with pytest.raises(ValueError, match="heldout applies to the training file"):
        load_glue("sst2", FIXTURES, "dev", heldout=2)
    with pytest.raises(ValueError, match="heldout: "):
        load_glue("sst2", FIXTURES, "train", heldout=50)
