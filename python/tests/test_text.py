"""ferry.Tokenizer against the libraries users have: ids identical to PyPI's `tokenizers` for
byte-level BPE (GPT-2's split, with and without a prefix space; Llama 3's split and
ignore_merges) and for character BPE with byte fallback (Llama 2's layout), and identical to the
SentencePiece library ferry links (Debian's spm_encode), on every document of a corpus made from
the machine's own text (tests/text/corpus.py); every tokenizer trained here, nothing downloaded.
Stages ferry lacks are refused by name; text that is not UTF-8 is a DataError naming the byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import ferry

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "text"))
import corpus  # noqa: E402

tokenizers = pytest.importorskip("tokenizers", reason="PyPI's tokenizers is the reference (scripts/install-deps.sh)")

# Llama 3's pre-tokenizer split, as its tokenizer.json writes it.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def docs():
    d = corpus.documents()
    assert len(d) > 1000 and any(not x.isascii() for x in d) and "" in d
    return d


def _train(docs, path, model, pre=None, normalizer=None, vocab=4000, special=(), alphabet=True, limit_alphabet=None):
    from tokenizers import Tokenizer, pre_tokenizers, trainers

    t = Tokenizer(model)
    if pre is not None:
        t.pre_tokenizer = pre
    if normalizer is not None:
        t.normalizer = normalizer
    kwargs = {"vocab_size": vocab, "special_tokens": list(special), "show_progress": False}
    if alphabet:
        kwargs["initial_alphabet"] = pre_tokenizers.ByteLevel.alphabet()
    if limit_alphabet is not None:
        kwargs["limit_alphabet"] = limit_alphabet
    t.train_from_iterator(docs, trainers.BpeTrainer(**kwargs))
    t.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def trained(docs, tmp_path_factory):
    """tokenizer.json files of the layouts hub models ship, trained on the corpus."""
    from tokenizers import Regex, models, normalizers, pre_tokenizers

    d = tmp_path_factory.mktemp("tokenizers")
    out = {
        "gpt2": _train(docs, d / "gpt2.json", models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False),
                       vocab=8000, special=["<|endoftext|>"]),
        "gpt2_prefix_space": _train(docs, d / "prefix.json", models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=True),
                                    vocab=3000, special=["<|endoftext|>"]),
        "llama3": _train(
            docs, d / "llama3.json", models.BPE(ignore_merges=True),
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
            vocab=6000, special=["<|begin_of_text|>", "<|end_of_text|>"]),
    }
    # Llama 2's layout: characters (the alphabet cut short, so rarer characters fall back to bytes),
    # the "▁" normalizer, and the 256 byte tokens in the vocab.
    path = _train(docs, d / "fallback.json", models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"),
                  normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                  special=["<unk>", "<s>", "</s>"], alphabet=False, limit_alphabet=150)
    j = json.loads(open(path, encoding="utf-8").read())
    base = max(j["model"]["vocab"].values()) + 1
    for b in range(256):
        j["model"]["vocab"][f"<0x{b:02X}>"] = base + b
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f)
    out["llama2_byte_fallback"] = path
    return out


@pytest.mark.parametrize("layout", ["gpt2", "gpt2_prefix_space", "llama3", "llama2_byte_fallback"])
def test_ids_identical_to_tokenizers(trained, docs, layout):
    ref = tokenizers.Tokenizer.from_file(trained[layout])
    want = [e.ids for e in ref.encode_batch(docs, add_special_tokens=False)]
    tok = ferry.Tokenizer.from_file(trained[layout])
    got = tok.encode_batch(docs, threads=2)
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    differ = [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b]
    assert not differ, f"{len(differ)} of {len(docs)} documents differ; the first: {docs[differ[0]][:200]!r}"
    if layout == "llama2_byte_fallback":  # the corpus reaches the fallback
        assert any(tok.token_id("<0xE6>") in ids for ids in got)
    assert tok.encode(docs[0]) == want[0]


def test_added_tokens_and_lookup(trained):
    tok = ferry.Tokenizer.from_file(trained["gpt2"])
    eot = tok.token_id("<|endoftext|>")
    assert eot is not None and tok.token_id("no such token anywhere") is None
    ids = tok.encode("a<|endoftext|>b<|endoftext|><|endoftext|>")
    assert ids.count(eot) == 3
    ref = tokenizers.Tokenizer.from_file(trained["gpt2"])
    assert ref.token_to_id("<|endoftext|>") == eot
    assert tok.token_id("Ġthe") == ref.token_to_id("Ġthe")


def test_sentencepiece_identical_to_the_linked_library(docs, tmp_path):
    if not shutil.which("spm_train") or not shutil.which("spm_encode"):
        pytest.skip("Debian's sentencepiece (spm_train, spm_encode) is not installed (scripts/install-deps.sh)")
    # SentencePiece reads lines: the documents with their line ends as spaces.
    lines = [x.replace("\r", " ").replace("\n", " ") for x in docs]
    train = tmp_path / "train.txt"
    train.write_text("\n".join(x for x in lines[:6000] if x.strip()), encoding="utf-8")
    prefix = tmp_path / "spm"
    subprocess.run(["spm_train", f"--input={train}", f"--model_prefix={prefix}", "--vocab_size=2000",
                    "--model_type=unigram", "--character_coverage=0.9995", "--byte_fallback=true", "--minloglevel=2"],
                   check=True, capture_output=True, timeout=300)
    src = tmp_path / "lines.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ref = subprocess.run(["spm_encode", f"--model={prefix}.model", "--output_format=id", f"--input={src}"],
                         check=True, capture_output=True, timeout=300).stdout.decode().split("\n")
    want = [[int(t) for t in line.split()] for line in ref[: len(lines)]]
    tok = ferry.Tokenizer.from_file(f"{prefix}.model")
    got = tok.encode_batch(lines, threads=2)
    differ = [i for i in range(len(lines)) if got[i] != want[i]]
    assert not differ, f"{len(differ)} of {len(lines)} lines differ; the first: {lines[differ[0]][:200]!r}"
    assert tok.vocab_size == 2000 and tok.token_id("<unk>") == 0 and tok.token_id("no such piece") is None


def _json_with(tmp_path, **changes):
    j = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}}
    for k, v in changes.items():
        j[k] = v
    path = tmp_path / "t.json"
    path.write_text(json.dumps(j))
    return str(path)


@pytest.mark.parametrize("stage,value,named", [
    ("model", {"type": "Unigram", "vocab": [["a", -1.0]]}, "model Unigram"),
    ("model", {"type": "WordPiece", "vocab": {"a": 0}}, "model WordPiece"),
    ("normalizer", {"type": "NFKC"}, "normalizer NFKC"),
    ("normalizer", {"type": "Sequence", "normalizers": [{"type": "NFC"}]}, "normalizer NFC"),
    ("pre_tokenizer", {"type": "Metaspace", "replacement": "▁"}, "pre_tokenizer Metaspace"),
    ("pre_tokenizer", {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
     "behavior MergedWithPrevious"),
])
def test_stages_ferry_lacks_are_refused_by_name(tmp_path, stage, value, named):
    with pytest.raises(ferry.Error, match=named):
        ferry.Tokenizer.from_file(_json_with(tmp_path, **{stage: value}))


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ferry.Error, match="bad.json: not JSON"):
        ferry.Tokenizer.from_file(str(bad))
    with pytest.raises(ferry.Error, match="cannot open"):
        ferry.Tokenizer.from_file(str(tmp_path / "missing.json"))
    with pytest.raises(ferry.Error, match=r"merge 0 \(a c\) names a token not in the vocab"):
        ferry.Tokenizer.from_file(_json_with(tmp_path, model={"type": "BPE", "vocab": {"a": 0}, "merges": ["a c"]}))
    spm = tmp_path / "broken.model"
    spm.write_bytes(b"\x00\x01 not a model")
    with pytest.raises(ferry.Error, match="broken.model: not a SentencePiece model"):
        ferry.Tokenizer.from_file(str(spm))


def test_text_that_is_not_utf8_names_the_byte(trained):
    tok = ferry.Tokenizer.from_file(trained["gpt2"])
    assert tok.encode("caf\u00e9".encode()) == tok.encode("caf\u00e9")
    for text, at in [(b"abc\xffdef", 3), (b"ok \xc3", 3), (b"\xed\xa0\x80 surrogate", 0), (b"ab\xc0\xaf overlong", 2)]:
        with pytest.raises(ferry.DataError, match=f"at byte {at}: not UTF-8"):
            tok.encode(text)
