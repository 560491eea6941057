"""The corpus: documents read from files (by default the Python standard library's own
source), tokenized, packed into sequences of seq_len + 1 tokens with an EOS id between
documents, and served in a deterministic order that depends only on the seed and a global
sample counter (the data position a checkpoint holds).

Sequence i of an epoch is tokens [i*L, i*L + L + 1) of that epoch's token stream (inputs are
its first L tokens, labels its last L), so every token is a label once per epoch. With
data.shuffle the documents are permuted per epoch (seed, epoch) before they are joined;
documents are not masked from each other inside a sequence (plain packing).

Tokenizers: "bytes" (UTF-8 bytes, ids 0..255, EOS 256) needs nothing; "bpe" trains a
byte-level BPE on the corpus with `tokenizers` once and caches it (and the tokenized corpus)
under a key of the corpus's content and the settings, so every run on the same corpus uses
the same tokenizer file; a path loads a tokenizer.json.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOS_TEXT = "<|endoftext|>"
CACHE_VERSION = "1"  # bump when the cached files' format or meaning changes


# ---------------------------------------------------------------- files and documents


def expand_paths(patterns: list[str], extensions: list[str]) -> list[Path]:
    """Files named by `patterns` (files, directories searched recursively for `extensions`,
    or glob patterns), each pattern's files sorted. FileNotFoundError names the pattern."""
    files: list[Path] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in extensions)
            if not found:
                raise FileNotFoundError(f"directory {pattern!r} holds no file ending in "
                                        f"{', '.join(extensions)}")
            files.extend(found)
        else:
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                           if Path(p).is_file())
            if not found:
                raise FileNotFoundError(f"{pattern!r}: no such file or directory, and no file "
                                        "matches it as a glob pattern")
            files.extend(found)
    return files


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted by path (installed packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))


def read_documents(files: list[Path], text_field: str) -> list[str]:
    """One document per text file, one per jsonl line (its `text_field`)."""
    documents = []
    for path in files:
        if path.suffix == ".jsonl":
            documents.extend(_jsonl_documents(path, text_field))
        else:
            documents.append(path.read_bytes().decode("utf-8", errors="replace"))
    return documents


def _jsonl_documents(path: Path, text_field: str) -> list[str]:
    documents = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON object: {error}") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path}:{number}: expected an object with a string field "
                                 f"{text_field!r} (data.text_field)")
            documents.append(record[text_field])
    return documents


def corpus_key(documents: list[str]) -> str:
    digest = hashlib.sha256()
    for document in documents:
        data = document.encode("utf-8", errors="replace")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


# ---------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and EOS = 256."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def identity(self) -> str:
        return "bytes"

    def encode_all(self, documents: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(d.encode("utf-8", errors="replace"), dtype=np.uint8)
                for d in documents]


class FileTokenizer:
    """A `tokenizers` tokenizer.json; EOS is its <|endoftext|> token (or, failing that, the
    first special token)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.name = str(path)
        self.tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        eos = self.tokenizer.token_to_id(EOS_TEXT)
        if eos is None:
            added = [t for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
            if not added:
                raise ValueError(f"data.tokenizer: {path} has no {EOS_TEXT} and no special token "
                                 "to separate documents with")
            eos = self.tokenizer.token_to_id(added[0].content)
        self.eos_id = eos

    def identity(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def encode_all(self, documents: list[str]) -> list[np.ndarray]:
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encodings = encode(documents, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]


def train_bpe(documents: list[str], vocab_size: int, path: Path) -> None:
    """A byte-level BPE (the GPT-2 / Qwen style: bytes mapped to printable characters, merges
    learned on the corpus) with <|endoftext|> as its one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(documents, trainer)
    _atomic_write(path, tokenizer.to_str().encode())


def _atomic_write(path: Path, data: bytes) -> None:
    # Several ranks or runs may fill the same cache: write aside, then rename.
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as handle:
        handle.write(data)
    os.replace(handle.name, path)


def _atomic_save_array(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npy", delete=False) as handle:
        np.save(handle, array)
    os.replace(handle.name, path)


def default_cache_dir() -> Path:
    if os.environ.get("MEGAMOE_CACHE_DIR"):
        return Path(os.environ["MEGAMOE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megamoe"


# ---------------------------------------------------------------- the packed corpus


@dataclass
class Corpus:
    """The tokenized documents in canonical order (file order, then line order)."""

    tokens: np.ndarray       # all documents' ids, concatenated, no separators
    offsets: np.ndarray      # int64 [num_documents + 1]: document d is tokens[offsets[d]:offsets[d+1]]
    eos_id: int
    vocab_size: int
    tokenizer_name: str
    description: str         # what was read, for the log
    key: str                 # content + tokenizer key (the cache key)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        # Each document is followed by one EOS in the stream.
        return len(self.tokens) + self.num_documents


def build_corpus(data_config, *, log=print, builder: bool = True) -> Corpus:
    """Reads, tokenizes (through the cache) and returns the corpus. When `builder` is False
    the cache must already hold it (other ranks wait for the builder and then read)."""
    if data_config.paths:
        files = expand_paths(data_config.paths, data_config.extensions)
        description = f"{len(files)} files from data.paths"
    else:
        files = stdlib_files()
        description = (f"the Python {sys.version_info.major}.{sys.version_info.minor} standard "
                       f"library ({len(files)} .py files)")
    documents = read_documents(files, data_config.text_field)
    if not documents:
        raise ValueError("data: the files hold no documents")
    content = corpus_key(documents)
    cache = Path(data_config.cache_dir).expanduser() if data_config.cache_dir else default_cache_dir()

    tokenizer = _make_tokenizer(data_config, documents, content, cache, log, builder)
    key = hashlib.sha256(f"{CACHE_VERSION}|{content}|{tokenizer.identity()}".encode()).hexdigest()
    if isinstance(tokenizer, ByteTokenizer):
        arrays = tokenizer.encode_all(documents)  # as fast as reading a cache
        tokens, offsets = _concatenate(arrays)
    else:
        tokens_path = cache / "corpus" / f"{key[:32]}.tokens.npy"
        offsets_path = cache / "corpus" / f"{key[:32]}.offsets.npy"
        if not (tokens_path.exists() and offsets_path.exists()):
            if not builder:
                raise RuntimeError(f"data: the tokenized corpus {tokens_path} is missing after "
                                   "the building rank finished (is data.cache_dir shared?)")
            log(f"tokenizing {description} with {tokenizer.name} (cached in {tokens_path.parent})")
            tokens, offsets = _concatenate(tokenizer.encode_all(documents))
            _atomic_save_array(offsets_path, offsets)
            _atomic_save_array(tokens_path, tokens)
        tokens, offsets = np.load(tokens_path), np.load(offsets_path)
    return Corpus(tokens=tokens, offsets=offsets, eos_id=tokenizer.eos_id,
                  vocab_size=tokenizer.vocab_size, tokenizer_name=tokenizer.name,
                  description=description, key=key)


def _make_tokenizer(data_config, documents, content, cache: Path, log, builder: bool):
    if data_config.tokenizer == "bytes":
        return ByteTokenizer()
    if data_config.tokenizer != "bpe":
        return FileTokenizer(Path(data_config.tokenizer))
    settings = f"{CACHE_VERSION}|bpe|{data_config.bpe_vocab_size}|{content}"
    path = cache / "tokenizers" / f"bpe-{hashlib.sha256(settings.encode()).hexdigest()[:32]}.json"
    if not path.exists():
        if not builder:
            raise RuntimeError(f"data: the tokenizer {path} is missing after the building rank "
                               "finished (is data.cache_dir shared?)")
        log(f"training a byte-level BPE of {data_config.bpe_vocab_size} tokens on the corpus "
            f"(cached as {path})")
        train_bpe(documents, data_config.bpe_vocab_size, path)
    return FileTokenizer(path)


def _concatenate(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = np.uint32 if max((a.max(initial=0) for a in arrays), default=0) >= 2**16 else np.uint16
    tokens = np.concatenate([a.astype(dtype, copy=False) for a in arrays]) if arrays \
        else np.zeros(0, dtype)
    return tokens, offsets


class PackedSequences:
    """Sequences of seq_len + 1 tokens in a deterministic order: sample n (a global counter)
    is sequence n % S of epoch n // S, S = sequences per epoch."""

    def __init__(self, corpus: Corpus, seq_len: int, seed: int, shuffle: bool):
        self.corpus, self.seq_len, self.seed, self.shuffle = corpus, seq_len, seed, shuffle
        self.sequences_per_epoch = (corpus.num_tokens - 1) // seq_len
        if self.sequences_per_epoch < 1:
            raise ValueError(f"data.seq_len: the corpus has {corpus.num_tokens} tokens, fewer than "
                             f"one sequence of seq_len + 1 = {seq_len + 1}")
        self._epoch, self._stream = None, None

    def _stream_of(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:
            corpus = self.corpus
            order = np.arange(corpus.num_documents)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(corpus.num_documents)
            stream = np.empty(corpus.num_tokens, dtype=np.int64)
            starts, ends = corpus.offsets[order], corpus.offsets[order + 1]
            position = 0
            for start, end in zip(starts, ends):
                length = end - start
                stream[position:position + length] = corpus.tokens[start:end]
                stream[position + length] = corpus.eos_id
                position += length + 1
            self._epoch, self._stream = epoch, stream
        return self._stream

    def sample(self, index: int) -> np.ndarray:
        epoch, i = divmod(index, self.sequences_per_epoch)
        stream = self._stream_of(epoch)
        return stream[i * self.seq_len:i * self.seq_len + self.seq_len + 1]


class DataLoader:
    """Micro-batches for one rank. Each optimizer step consumes world * grad_accum *
    micro_batch_size samples; rank r's micro-batch j of the step starting at sample p holds
    samples p + (j * world + r) * B + [0, B). `position` is the next step's p."""

    def __init__(self, sequences: PackedSequences, micro_batch_size: int, grad_accum: int,
                 rank: int, world_size: int, device: torch.device):
        self.sequences, self.batch, self.accum = sequences, micro_batch_size, grad_accum
        self.rank, self.world, self.device = rank, world_size, device
        self.position = 0

    @property
    def samples_per_step(self) -> int:
        return self.world * self.accum * self.batch

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The grad_accum (input_ids, labels) pairs, [B, L] int64 each, of the next step."""
        micro_batches = []
        for j in range(self.accum):
            first = self.position + (j * self.world + self.rank) * self.batch
            rows = np.stack([self.sequences.sample(first + b) for b in range(self.batch)])
            rows = torch.from_numpy(rows)
            inputs, labels = rows[:, :-1], rows[:, 1:]
            pin = self.device.type == "cuda"
            micro_batches.append((_to(inputs, self.device, pin), _to(labels, self.device, pin)))
        self.position += self.samples_per_step
        return micro_batches

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def _to(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    tensor = tensor.contiguous()
    if pin:
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
