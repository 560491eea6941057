"""The trainer's data pipeline: files and jsonl, tokenizers, packing, order, the loader."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megamoe.train import data


def _config(tmp_path, paths, **extra):
    settings = dict(paths=[str(p) for p in paths], extensions=[".txt", ".md", ".jsonl"],
                    text_field="text", tokenizer="bytes", bpe_vocab_size=300, seq_len=8,
                    shuffle=False, cache_dir=str(tmp_path / "cache"))
    settings.update(extra)
    return SimpleNamespace(**settings)


@pytest.fixture
def corpus_dir(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("second document")
    (root / "a.txt").write_text("first")
    (root / "sub" / "c.md").write_text("third, in a subfolder")
    (root / "skip.bin").write_bytes(b"\x00not text")
    records = [{"text": "jsonl one"}, {"text": "jsonl two", "id": 2}]
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return root


def test_expand_paths_sorted_and_filtered(corpus_dir):
    files = data.expand_paths([str(corpus_dir)], [".txt", ".md", ".jsonl"])
    assert [f.relative_to(corpus_dir).as_posix() for f in files] == \
        ["a.txt", "b.txt", "d.jsonl", "sub/c.md"]
    assert data.expand_paths([str(corpus_dir / "*.txt")], [".txt"]) == \
        [corpus_dir / "a.txt", corpus_dir / "b.txt"]
    with pytest.raises(FileNotFoundError, match="no such file"):
        data.expand_paths([str(corpus_dir / "missing.txt")], [".txt"])
    with pytest.raises(FileNotFoundError, match="holds no file"):
        data.expand_paths([str(corpus_dir / "sub")], [".jsonl"])


def test_documents_and_byte_packing(tmp_path, corpus_dir):
    corpus = data.build_corpus(_config(tmp_path, [corpus_dir]), log=lambda m: None)
    texts = ["first", "second document", "jsonl one", "jsonl two", "third, in a subfolder"]
    assert corpus.num_documents == 5
    stream = b"".join(t.encode() + b"\x00" for t in texts)  # \x00 marks where EOS goes
    expected = np.frombuffer(stream, dtype=np.uint8).astype(np.int64)
    expected[expected == 0] = data.ByteTokenizer.eos_id
    assert corpus.num_tokens == len(expected)

    seqs = data.PackedSequences(corpus, seq_len=8, seed=0, shuffle=False)
    assert seqs.sequences_per_epoch == (len(expected) - 1) // 8
    for i in range(seqs.sequences_per_epoch):
        np.testing.assert_array_equal(seqs.sample(i), expected[i * 8:i * 8 + 9])
    # Labels (positions 1..8 of each sample) cover every token after the first exactly once.
    labels = np.concatenate([seqs.sample(i)[1:] for i in range(seqs.sequences_per_epoch)])
    np.testing.assert_array_equal(labels, expected[1:1 + len(labels)])


def test_jsonl_missing_field_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'text'"):
        data.build_corpus(_config(tmp_path, [path]), log=lambda m: None)
    path.write_text('{"body": "a"}\n{"body": "bc"}\n')
    corpus = data.build_corpus(_config(tmp_path, [path], text_field="body"), log=lambda m: None)
    assert corpus.num_documents == 2 and corpus.num_tokens == 1 + 1 + 2 + 1


def test_order_is_deterministic_and_seeded(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_text(f"document number {i} " * (1 + i % 3))
    corpus = data.build_corpus(_config(tmp_path, [docs]), log=lambda m: None)

    def samples(seed, count=30):
        seqs = data.PackedSequences(corpus, seq_len=16, seed=seed, shuffle=True)
        return np.stack([seqs.sample(i) for i in range(count)])

    np.testing.assert_array_equal(samples(3), samples(3))
    assert not np.array_equal(samples(3), samples(4))
    seqs = data.PackedSequences(corpus, seq_len=16, seed=3, shuffle=True)
    per_epoch = seqs.sequences_per_epoch
    # A new epoch reshuffles the documents.
    assert not np.array_equal(seqs.sample(0), seqs.sample(per_epoch))
    np.testing.assert_array_equal(seqs.sample(per_epoch + 1), seqs.sample(per_epoch + 1))


def test_loader_partitions_samples_and_resumes(tmp_path, corpus_dir):
    corpus = data.build_corpus(_config(tmp_path, [corpus_dir]), log=lambda m: None)
    seqs = data.PackedSequences(corpus, seq_len=4, seed=0, shuffle=False)
    world, batch, accum = 2, 2, 3
    loaders = [data.DataLoader(seqs, batch, accum, rank, world, torch.device("cpu"))
               for rank in range(world)]
    seen = []
    for loader in loaders:
        for inputs, labels in loader.next_step():
            assert inputs.shape == labels.shape == (batch, 4)
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            seen.extend(tuple(row.tolist()) for row in inputs)
    expected = [tuple(seqs.sample(i)[:-1].tolist()) for i in range(world * batch * accum)]
    assert sorted(seen) == sorted(expected)
    assert loaders[0].state_dict() == {"position": world * batch * accum}

    resumed = data.DataLoader(seqs, batch, accum, 0, world, torch.device("cpu"))
    resumed.load_state_dict(loaders[0].state_dict())
    following = loaders[0].next_step()
    for (a, b), (c, d) in zip(resumed.next_step(), following):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_bpe_trained_once_and_cached(tmp_path, corpus_dir):
    pytest.importorskip("tokenizers")
    messages = []
    config = _config(tmp_path, [corpus_dir], tokenizer="bpe", bpe_vocab_size=300)
    first = data.build_corpus(config, log=messages.append)
    assert any("training a byte-level BPE" in m for m in messages)
    assert any("tokenizing" in m for m in messages)
    tokenizer_files = list((tmp_path / "cache" / "tokenizers").glob("bpe-*.json"))
    assert len(tokenizer_files) == 1
    messages.clear()
    second = data.build_corpus(config, log=messages.append)
    assert messages == []  # the tokenizer and the tokenized corpus came from the cache
    np.testing.assert_array_equal(first.tokens, second.tokens)
    assert first.key == second.key and first.vocab_size <= 300

    tokenizer = data.FileTokenizer(tokenizer_files[0])
    assert tokenizer.eos_id == tokenizer.tokenizer.token_to_id(data.EOS_TEXT)
    ids = first.tokens[first.offsets[1]:first.offsets[2]].tolist()
    assert tokenizer.tokenizer.decode(ids) == "second document"


def test_stdlib_corpus_is_found():
    files = data.stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert not any("site-packages" in f.parts for f in files)
