"""Text to token ids: a Hugging Face ``tokenizer.json``, a BPE trained here, or bytes.

Three tokenizers with one interface (``vocab_size``, ``encode``, ``encode_batch``,
``decode``, ``bos_id``, ``eos_id``):

- :class:`Tokenizer` wraps the Hugging Face ``tokenizers`` library's ``Tokenizer``: what a
  ``tokenizer.json`` next to a checkpoint holds (:func:`load_tokenizer` reads one from its
  file or its folder, with the special tokens of ``tokenizer_config.json`` when present), or
  a byte-level BPE trained locally by :func:`train_bpe` (no network).
- :class:`ByteTokenizer`: UTF-8 bytes as ids 0..255, what ``parallax demo`` trains on
  (``GPTConfig.tiny``'s vocabulary of 256); needs no package.

References:
  Hugging Face ``tokenizers`` (``Tokenizer.from_file``, ``BpeTrainer``); Radford et al.
  2019 (GPT-2's byte-level BPE); Sennrich et al. 2016, "Neural Machine Translation of Rare
  Words with Subword Units" (BPE).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

from parallax.data.extras import require

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


class ByteTokenizer:
    """UTF-8 bytes as token ids ``0 .. 255``; no special tokens.

    Example:
      >>> tok = ByteTokenizer()
      >>> tok.encode("hé").tolist(), tok.decode([104, 195, 169]), tok.vocab_size
      ([104, 195, 169], 'hé', 256)
    """

    vocab_size = 256
    bos_id = eos_id = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        """Invalid UTF-8 (a sequence cut inside a character) decodes to U+FFFD."""
        return bytes(np.asarray(ids, np.uint8).tolist()).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


def _token_name(value) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (a ``tokenizer.json``), ids as NumPy.

    Args:
      tokenizer: the ``tokenizers.Tokenizer``.
      bos_token, eos_token: the names of the beginning- and end-of-text tokens (their ids
        are ``bos_id`` / ``eos_id``; None where the tokenizer has none).
      add_special_tokens: what ``encode`` passes to the library: the tokenizer's own
        template (Llama's adds the BOS token in front; GPT-2's adds nothing), as
        transformers' tokenizers do by default.

    Example:
      >>> tok = train_bpe(["low lower lowest"] * 20, vocab_size=270)
      >>> tok.decode(tok.encode("lowest")), tok.eos_id == tok.token_id("<|endoftext|>")
      ('lowest', True)
    """

    def __init__(self, tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, add_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_special_tokens = add_special_tokens
        self.bos_id = None if bos_token is None else self.token_id(bos_token)
        self.eos_id = None if eos_token is None else self.token_id(eos_token)

    @property
    def vocab_size(self) -> int:
        """Ids are ``0 .. vocab_size - 1`` (added tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"parallax.data.Tokenizer: the token {token!r} is not in the "
                             f"vocabulary of {self.vocab_size}; name one of its special tokens.")
        return found

    def encode(self, text: str) -> np.ndarray:
        ids = self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids
        return np.asarray(ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Many texts at once (the library encodes them in parallel threads)."""
        found = self.tokenizer.encode_batch(list(texts),
                                            add_special_tokens=self.add_special_tokens)
        return [np.asarray(e.ids, np.int32) for e in found]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).ravel()],
                                     skip_special_tokens=skip_special_tokens)

    def save(self, directory) -> pathlib.Path:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (its special tokens, and
        ``PreTrainedTokenizerFast`` as the class transformers' ``AutoTokenizer`` builds)
        into ``directory``, e.g. next to a checkpoint; returns the ``tokenizer.json`` path."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / TOKENIZER_FILE))
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        config |= {k: v for k, v in (("bos_token", self.bos_token),
                                     ("eos_token", self.eos_token)) if v is not None}
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return directory / TOKENIZER_FILE

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r})")


def load_tokenizer(path, *, bos_token: str | None = None, eos_token: str | None = None,
                   add_special_tokens: bool = True) -> Tokenizer:
    """Reads a Hugging Face ``tokenizer.json``: the file, or the folder holding it (a
    checkpoint's, as ``px.models.from_pretrained`` reads; or one :meth:`Tokenizer.save`
    wrote).

    The special tokens come from the arguments, else from ``tokenizer_config.json`` beside
    the file (``bos_token``, ``eos_token``), else there are none.

    Args:
      path: a ``tokenizer.json`` file or a folder with one.
      bos_token, eos_token: override the names of the special tokens.
      add_special_tokens: apply the tokenizer's template when encoding (see
        :class:`Tokenizer`).

    Returns:
      A :class:`Tokenizer`.

    Raises:
      FileNotFoundError: no ``tokenizer.json`` there (the message names the path and the
        offline alternatives).

    Example:
      >>> import tempfile
      >>> folder = tempfile.mkdtemp()
      >>> _ = train_bpe(["a b c"] * 10, vocab_size=262).save(folder)
      >>> load_tokenizer(folder).eos_token
      '<|endoftext|>'
    """
    tokenizers = require("tokenizers", "parallax.data.load_tokenizer")
    path = pathlib.Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"parallax.data.load_tokenizer: no {TOKENIZER_FILE} at {file}. Pass the file or "
            "the checkpoint folder holding it; offline, train one with "
            "parallax.data.train_bpe(texts, vocab_size) or use parallax.data.ByteTokenizer().")
    config_file = file.parent / CONFIG_FILE
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    bos = bos_token or _token_name(config.get("bos_token"))
    eos = eos_token or _token_name(config.get("eos_token"))
    return Tokenizer(tokenizers.Tokenizer.from_file(str(file)), bos_token=bos, eos_token=eos,
                     add_special_tokens=add_special_tokens)


def train_bpe(texts: Iterable[str], vocab_size: int, *,
              special_tokens: Sequence[str] = ("<|endoftext|>",),
              eos_token: str | None = "<|endoftext|>", min_frequency: int = 2,
              progress: bool = False) -> Tokenizer:
    """Trains a byte-level BPE on ``texts`` here (GPT-2's scheme: any text encodes, no
    unknown token), with the ``tokenizers`` library; nothing is downloaded.

    Args:
      texts: the training texts (an iterable of strings, read once).
      vocab_size: the vocabulary wanted, at least 256 bytes + the special tokens; the
        result may be smaller when the texts hold fewer merges.
      special_tokens: added first (ids ``0 ..``), never split.
      eos_token: which of them ends a text (``Tokenizer.eos_id``), or None.
      min_frequency: a pair merges only when seen this often.
      progress: the library's own progress bar.

    Returns:
      A :class:`Tokenizer` (``save`` it next to the checkpoint).

    Example:
      >>> tok = train_bpe(["the cat sat on the mat"] * 50, vocab_size=280)
      >>> tok.decode(tok.encode("the mat")), 257 <= tok.vocab_size <= 280
      ('the mat', True)
    """
    api = "parallax.data.train_bpe"
    lib = require("tokenizers", api)
    special_tokens = list(special_tokens)
    if eos_token is not None and eos_token not in special_tokens:
        raise ValueError(f"{api}: eos_token={eos_token!r} is not among special_tokens="
                         f"{special_tokens}; add it there, or pass eos_token=None.")
    least = 256 + len(special_tokens)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < least:
        raise ValueError(f"{api}: vocab_size={vocab_size!r} must be an int >= {least} (the "
                         f"256 byte tokens and {len(special_tokens)} special tokens).")
    tokenizer = lib.Tokenizer(lib.models.BPE())
    tokenizer.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special_tokens,
        initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tokenizer, eos_token=eos_token)
