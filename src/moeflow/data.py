"""The training corpus and its tokenizer, prepared once and cached.

The default corpus is real text that every machine has offline: the source files (``*.py``) of the
running interpreter's standard library, without its test suites and ``site-packages`` (about
10 MB on CPython 3.11). ``--data PATH`` takes any text file or folder instead. Documents are split
into train and validation deterministically by a hash of their path, the tokenizer is a byte-level
BPE trained with Hugging Face ``tokenizers`` on the training documents only (or raw bytes), and
the token streams are stored as flat arrays that every worker memory-maps and samples its rows of
each step's global batch from. A lock makes concurrent workers (torchrun, the emulated cluster) prepare it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import sysconfig
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moeflow.files import write_atomic

TOKENIZERS = ("bpe", "bytes")
PRETRAINED = "pretrained"  # a given tokenizer.json (a transformers model's), not trained here
END_OF_TEXT = "<|endoftext|>"
_FORMAT = 1  # bump when the cached layout changes
_SKIPPED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class PretrainedTokenizer:
    """A model's own tokenizer (its ``tokenizer.json``) and the token that ends a document."""

    path: str
    end_of_text_id: int | None  # None: documents are joined with no separator

    def digest(self) -> str:
        return hashlib.sha256(Path(self.path).read_bytes()).hexdigest()[:16] + f"|{self.end_of_text_id}"


@dataclass(frozen=True)
class PreparedCorpus:
    """A tokenized corpus in the cache: token arrays, the tokenizer and corpus statistics."""

    directory: str
    source: str
    tokenizer: str
    vocab_size: int
    documents: int
    train_tokens: int
    val_tokens: int
    bytes: int
    unigram_entropy: float  # nats per token of the training stream (the best context-free model)
    unigram_val_loss: float  # cross-entropy of the validation stream under the training unigram

    @property
    def train_path(self) -> Path:
        return Path(self.directory) / "train.npy"

    @property
    def val_path(self) -> Path:
        return Path(self.directory) / "val.npy"

    @property
    def tokenizer_path(self) -> Path:
        return Path(self.directory) / "tokenizer.json"

    def load(self, split: str) -> np.ndarray:
        """The token stream of ``split`` ("train" or "val"), memory-mapped."""
        return np.load(self.train_path if split == "train" else self.val_path, mmap_mode="r")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def stdlib_directory() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(data: str | None) -> tuple[Path, list[Path]]:
    """The root and the documents of the corpus: the standard library's sources when ``data`` is
    None, else the file ``data`` or every non-hidden text file under the folder ``data``."""
    if data is None:
        root = stdlib_directory()
        files = [p for p in root.rglob("*.py") if not _SKIPPED_PARTS & set(p.relative_to(root).parts)]
    else:
        path = Path(data).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"data path {data!r} does not exist; pass an existing text file or folder with --data, "
                "or leave --data out to train on the Python standard library's sources"
            )
        if path.is_file():
            root, files = path.parent, [path]
        else:
            root = path
            files = [
                p for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
                and _is_text(p)
            ]
    files.sort()
    if not files:
        raise ValueError(f"no text files found under {data!r}; --data needs a text file or a folder of them")
    return root, files


def _is_text(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(4096)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start > len(head) - 4  # a character cut at the end of the sample
    return True


def is_validation_document(relative_path: str, val_percent: float) -> bool:
    """Deterministic split by a stable hash of the path (unchanged when other files come or go)."""
    return zlib.crc32(relative_path.encode()) % 10_000 < val_percent * 100


def default_cache_root(environment: Mapping[str, str]) -> Path:
    """Where token streams are cached: ``MOEFLOW_CACHE`` or ~/.cache/moeflow (entry points pass
    their ``os.environ``)."""
    return Path(environment.get("MOEFLOW_CACHE", Path.home() / ".cache" / "moeflow"))


def _corpus_key(root: Path, files: list[Path], tokenizer: str, vocab_size: int, val_percent: float) -> str:
    digest = hashlib.sha256(f"{_FORMAT}|{tokenizer}|{vocab_size}|{val_percent}|{root}".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def prepare_corpus(
    data: str | None = None, tokenizer: str = "bpe", vocab_size: int = 4096, val_percent: float = 5.0,
    cache_dir: str | None = None, cache_root: Path | None = None, pretrained: PretrainedTokenizer | None = None,
) -> PreparedCorpus:
    """Tokenize the corpus (or find it in the cache) and return where it lies: ``cache_dir`` if
    given, else a folder named by the corpus's key under ``cache_root`` (default ~/.cache/moeflow).
    With ``pretrained`` that tokenizer is used as it is (``tokenizer`` and ``vocab_size`` are unused)."""
    if pretrained is None:
        _check_tokenizer(tokenizer, vocab_size)
    elif not Path(pretrained.path).is_file():
        raise FileNotFoundError(f"tokenizer file {pretrained.path!r} does not exist")
    if not 0 < val_percent < 100:
        raise ValueError(f"val_percent={val_percent} must be between 0 and 100 (exclusive)")
    root, files = corpus_files(data)
    kind = tokenizer if pretrained is None else f"{PRETRAINED}|{pretrained.digest()}"
    key = _corpus_key(root, files, kind, vocab_size if pretrained is None else 0, val_percent)
    root_dir = cache_root if cache_root is not None else Path.home() / ".cache" / "moeflow"
    directory = Path(cache_dir) if cache_dir is not None else root_dir / f"corpus-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one preparer; the others wait and then read the cache
        meta = directory / "corpus.json"
        if meta.exists():
            return PreparedCorpus(**json.loads(meta.read_text()))
        corpus = _build(directory, root, files, data, tokenizer, vocab_size, val_percent, pretrained)
        write_atomic(meta, json.dumps(corpus.to_dict(), indent=2).encode())
        return corpus


def _check_tokenizer(tokenizer: str, vocab_size: int) -> None:
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer={tokenizer!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
    if tokenizer == "bpe" and not 256 < vocab_size <= 65_535:
        raise ValueError(f"vocab_size={vocab_size} must be in (256, 65535] for the BPE tokenizer")


def _read_documents(root: Path, files: list[Path]) -> Iterator[tuple[str, str]]:
    for path in files:
        yield str(path.relative_to(root)), path.read_text(encoding="utf-8", errors="replace")


def _build(
    directory: Path, root: Path, files: list[Path], data: str | None, tokenizer_kind: str, vocab_size: int,
    val_percent: float, pretrained: PretrainedTokenizer | None,
) -> PreparedCorpus:
    documents = list(_read_documents(root, files))
    train_docs: list[str] = []
    val_docs: list[str] = []
    for name, text in documents:
        (val_docs if is_validation_document(name, val_percent) else train_docs).append(text)
    if not val_docs or not train_docs:  # one document (or very few): split the text itself
        joined = "\n".join(text for _, text in documents)
        cut = int(len(joined) * (1 - val_percent / 100))
        train_docs, val_docs = [joined[:cut]], [joined[cut:]]
    if pretrained is None:
        tokenizer = _train_tokenizer(train_docs, tokenizer_kind, vocab_size)
        end: list[int] = [tokenizer.token_to_id(END_OF_TEXT)]
    else:
        tokenizer = load_tokenizer(pretrained.path)
        tokenizer_kind = PRETRAINED
        end = [] if pretrained.end_of_text_id is None else [pretrained.end_of_text_id]
    tokenizer.save(str(directory / "tokenizer.json"))
    token_type = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.uint32
    streams = {}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        ids = [[*encoding.ids, *end] for encoding in tokenizer.encode_batch(docs, add_special_tokens=False)]
        stream = np.fromiter((i for doc in ids for i in doc), dtype=token_type)
        np.save(directory / f"{split}.npy.tmp.npy", stream)
        os.replace(directory / f"{split}.npy.tmp.npy", directory / f"{split}.npy")
        streams[split] = stream
    vocab = tokenizer.get_vocab_size()
    counts = np.bincount(streams["train"], minlength=vocab).astype(np.float64)
    p = counts / counts.sum()
    entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    smoothed = (counts + 1) / (counts.sum() + vocab)  # add-one, so unseen validation tokens are finite
    val_loss = float(-np.log(smoothed[streams["val"].astype(np.int64)]).mean())
    version = ".".join(map(str, sys.version_info[:3]))
    source = f"Python {version} standard library sources ({root})" if data is None else str(Path(data).resolve())
    return PreparedCorpus(
        directory=str(directory), source=source,
        tokenizer=tokenizer_kind, vocab_size=vocab, documents=len(documents),
        train_tokens=int(streams["train"].size), val_tokens=int(streams["val"].size),
        bytes=sum(len(text.encode()) for _, text in documents),
        unigram_entropy=entropy, unigram_val_loss=val_loss,
    )


def _train_tokenizer(train_docs: list[str], kind: str, vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if kind == "bytes":  # one token per byte: the 256 byte symbols and the end-of-text token
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {symbol: i for i, symbol in enumerate(alphabet)}
        vocab[END_OF_TEXT] = len(vocab)
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    else:
        tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    if kind == "bpe":
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[END_OF_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(train_docs, trainer=trainer)
    else:
        tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


def load_tokenizer(path: str | Path):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
