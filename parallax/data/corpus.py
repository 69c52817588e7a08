"""A tokenized corpus: every document's ids in one flat array, with its offsets.

Tokenizing shows a progress bar (documents, tokens so far); the result is a
:class:`Corpus`: ``tokens`` (int32, all documents end to end) and ``offsets`` (document
``i`` is ``tokens[offsets[i]:offsets[i + 1]]``). Packing reads only the lengths; a batch
reads only its rows' slices, so a corpus saved once (:meth:`Corpus.save`) and opened
memory-mapped on every process (:meth:`Corpus.load`) costs each process the pages of its
own rows.

Every corpus carries a fingerprint of its ids (BLAKE2b), which a loader's saved state
records: a resume on other data is refused rather than silently reading other rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Iterable, Sequence

import jax
import numpy as np

META_FILE = "corpus.json"


def fingerprint(tokens: np.ndarray, offsets: np.ndarray) -> str:
    """A short hash of the ids and the document boundaries."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(np.ascontiguousarray(offsets, np.int64).tobytes())
    digest.update(np.ascontiguousarray(tokens, np.int32).tobytes())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Documents as token ids: ``tokens`` int32 ``[N]``, ``offsets`` int64 ``[D + 1]``.

    Example:
      >>> corpus = Corpus.from_documents([[1, 2, 3], [4], [5, 6]])
      >>> corpus.num_documents, corpus.num_tokens, corpus.document(2).tolist()
      (3, 6, [5, 6])
    """

    tokens: np.ndarray
    offsets: np.ndarray
    fingerprint: str

    @classmethod
    def from_documents(cls, documents: Iterable) -> Corpus:
        """A corpus of the given id sequences, in order."""
        parts = [np.asarray(d, np.int32).ravel() for d in documents]
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return cls(tokens, offsets, fingerprint(tokens, offsets))

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[D]``: each document's number of tokens."""
        return np.diff(self.offsets)

    def document(self, index: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[index]:self.offsets[index + 1]])

    def select(self, indices: Sequence[int]) -> Corpus:
        """The documents ``indices``, in that order, as a new corpus."""
        return Corpus.from_documents(self.document(int(i)) for i in indices)

    def split(self, held_out: float | int, seed: int = 0) -> tuple[Corpus, Corpus]:
        """``(train, held-out)`` by documents: ``held_out`` a fraction in (0, 1) or a count,
        chosen by a seeded permutation (NumPy's frozen legacy stream: the same split on any
        version); each part keeps the corpus's order.

        Example:
          >>> train, test = Corpus.from_documents([[i] for i in range(10)]).split(0.2)
          >>> train.num_documents, test.num_documents
          (8, 2)
        """
        d = self.num_documents
        count = round(held_out * d) if isinstance(held_out, float) else held_out
        if not (isinstance(held_out, (int, float)) and 0 < count < d):
            raise ValueError(
                f"parallax.data.Corpus.split: held_out={held_out!r} leaves {count} of the "
                f"{d} documents for evaluation; pass a fraction in (0, 1) or a count in "
                f"[1, {d - 1}] (a corpus of one document cannot be split: add documents).")
        chosen = np.sort(np.random.RandomState(seed).permutation(d)[:count])
        rest = np.setdiff1d(np.arange(d), chosen)
        return self.select(rest), self.select(chosen)

    def save(self, directory) -> pathlib.Path:
        """Writes ``tokens.npy``, ``offsets.npy`` and ``corpus.json`` (the fingerprint)."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / "tokens.npy", np.asarray(self.tokens, np.int32))
        np.save(directory / "offsets.npy", np.asarray(self.offsets, np.int64))
        meta = {"fingerprint": self.fingerprint, "documents": self.num_documents,
                "tokens": self.num_tokens}
        (directory / META_FILE).write_text(json.dumps(meta) + "\n")
        return directory

    @classmethod
    def load(cls, directory, *, mmap: bool = True) -> Corpus:
        """A saved corpus; ``mmap``: the ids stay on disk and are read as rows need them.

        Example:
          >>> import tempfile
          >>> folder = Corpus.from_documents([[1, 2], [3]]).save(tempfile.mkdtemp())
          >>> Corpus.load(folder).document(1).tolist()
          [3]
        """
        directory = pathlib.Path(directory)
        if not (directory / META_FILE).is_file():
            raise FileNotFoundError(
                f"parallax.data.Corpus.load: no {META_FILE} in {directory}; save a corpus "
                "there with Corpus.save(directory) (e.g. after parallax.data.tokenize).")
        meta = json.loads((directory / META_FILE).read_text())
        mode = "r" if mmap else None
        return cls(np.load(directory / "tokens.npy", mmap_mode=mode),
                   np.load(directory / "offsets.npy"), meta["fingerprint"])

    def __repr__(self) -> str:
        return (f"Corpus({self.num_documents} documents, {self.num_tokens} tokens, "
                f"fingerprint {self.fingerprint})")


def read_text_files(folder, pattern: str = "**/*.txt", separator: str | None = None
                    ) -> list[str]:
    """The documents of a folder of text files, in path order (the same on every process).

    Args:
      folder: where the files are.
      pattern: which files (``pathlib`` glob, recursive by default).
      separator: None: one document per file; else each file is split on it (e.g.
        ``"\\n\\n"``), empty pieces dropped.

    Returns:
      The documents' texts.

    Example:
      >>> import pathlib, tempfile
      >>> folder = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (folder / "a.txt").write_text("one\\n\\ntwo")
      >>> read_text_files(folder, separator="\\n\\n")
      ['one', 'two']
    """
    folder = pathlib.Path(folder)
    files = sorted(p for p in folder.glob(pattern) if p.is_file())
    if not files:
        raise FileNotFoundError(
            f"parallax.data.read_text_files: no files match {pattern!r} under {folder} "
            f"({'missing' if not folder.exists() else 'exists'}); point it at the folder of "
            "your text files, or pass pattern= (e.g. '**/*.md').")
    texts = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts += [text] if separator is None else [t for t in text.split(separator) if t]
    return texts


def tokenize(texts: Sequence[str], tokenizer, *, append_eos: bool = False,
             progress: bool | str = "auto", chunk: int = 256,
             description: str = "tokenizing") -> Corpus:
    """Each text as one document of token ids, with a progress bar (documents; tokens in the
    bar's postfix).

    Args:
      texts: the documents (a sequence, so the bar knows the total).
      tokenizer: a :class:`~parallax.data.Tokenizer`, :class:`~parallax.data.ByteTokenizer`
        or anything with ``encode_batch``.
      append_eos: end each document with the tokenizer's ``eos_id`` (a model then learns
        where texts end; an error when the tokenizer has none).
      progress: show a ``tqdm`` bar; ``"auto"``: on process 0 only.
      chunk: texts per ``encode_batch`` call.
      description: the bar's label.

    Returns:
      A :class:`Corpus`.

    Example:
      >>> from parallax.data import ByteTokenizer
      >>> tokenize(["ab", "c"], ByteTokenizer(), progress=False).tokens.tolist()
      [97, 98, 99]
    """
    eos = getattr(tokenizer, "eos_id", None)
    if append_eos and eos is None:
        raise ValueError(f"parallax.data.tokenize: append_eos=True, but {tokenizer!r} has no "
                         "end-of-text token; pass append_eos=False, or a tokenizer with one "
                         "(train_bpe's '<|endoftext|>', or load_tokenizer(eos_token=...)).")
    show = jax.process_index() == 0 if progress == "auto" else bool(progress)
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(texts), desc=description, unit="doc")
    documents, count = [], 0
    try:
        for start in range(0, len(texts), chunk):
            encoded = tokenizer.encode_batch(list(texts[start:start + chunk]))
            if append_eos:
                encoded = [np.append(ids, np.int32(eos)) for ids in encoded]
            documents += encoded
            count += sum(len(ids) for ids in encoded)
            if bar is not None:
                bar.update(len(encoded))
                bar.set_postfix(tokens=f"{count:,}")
    finally:
        if bar is not None:
            bar.close()
    return Corpus.from_documents(documents)


def tokenize_folder(folder, tokenizer, *, pattern: str = "**/*.txt",
                    separator: str | None = None, append_eos: bool = False,
                    progress: bool | str = "auto") -> Corpus:
    """:func:`read_text_files` then :func:`tokenize` (with its progress bar).

    Example:
      >>> import pathlib, tempfile
      >>> from parallax.data import ByteTokenizer
      >>> folder = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (folder / "a.txt").write_text("hi")
      >>> tokenize_folder(folder, ByteTokenizer(), progress=False).num_tokens
      2
    """
    texts = read_text_files(folder, pattern, separator)
    return tokenize(texts, tokenizer, append_eos=append_eos, progress=progress,
                    description=f"tokenizing {pathlib.Path(folder).name or folder}")
