"""From text to packed, sharded, resumable batches (``px.data``).

- Tokenizers: :class:`Tokenizer` (a Hugging Face ``tokenizer.json``: :func:`load_tokenizer`
  from a file or a checkpoint's folder, :func:`train_bpe` trained here), and
  :class:`ByteTokenizer` (UTF-8 bytes).
- A corpus: :func:`tokenize` / :func:`tokenize_folder` (with a progress bar) give a
  :class:`Corpus` (all ids end to end, document offsets; saved and memory-mapped).
- Packing: :func:`pack` plans rows of ``T + 1`` tokens from the documents' lengths
  (documents kept apart by segment ids, positions restarting per document).
- Loading: :class:`PackedBatches`, on grain: each process reads its own rows of every
  global batch (``px.distributed.process_slice``), and the iterator's state (a batch index)
  resumes the stream exactly (``px.checkpoint.save(..., extra={"data": it.get_state()})``).

``tokenizers`` and ``grain`` come with the ``data`` extra and are imported only when used.
See ``docs/data.md``.
"""

from parallax.data.corpus import Corpus as Corpus
from parallax.data.corpus import read_text_files as read_text_files
from parallax.data.corpus import tokenize as tokenize
from parallax.data.corpus import tokenize_folder as tokenize_folder
from parallax.data.loader import PackedBatches as PackedBatches
from parallax.data.loader import PackedIterator as PackedIterator
from parallax.data.packing import PackedRows as PackedRows
from parallax.data.packing import materialize as materialize
from parallax.data.packing import pack as pack
from parallax.data.tokenizer import ByteTokenizer as ByteTokenizer
from parallax.data.tokenizer import Tokenizer as Tokenizer
from parallax.data.tokenizer import load_tokenizer as load_tokenizer
from parallax.data.tokenizer import train_bpe as train_bpe

__all__ = ["ByteTokenizer", "Corpus", "PackedBatches", "PackedIterator", "PackedRows",
           "Tokenizer", "load_tokenizer", "materialize", "pack", "read_text_files",
           "tokenize", "tokenize_folder", "train_bpe"]
