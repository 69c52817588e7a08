"""A Hugging Face checkpoint directory: ``config.json`` and its ``*.safetensors`` files.

Both layouts ``save_pretrained`` writes are read: one ``model.safetensors``, or shards named
by ``model.safetensors.index.json`` (``{"weight_map": {tensor name: file}}``). Tensors are
opened lazily with ``safetensors.safe_open(..., framework="numpy")`` and read by slice
(``get_slice(name)[rows, cols]``), so a process reads only the parts its devices hold; the
bytes read are counted (tests check that a sharded load reads no full copy).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import numpy as np

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _safetensors():
    try:
        import safetensors
    except ImportError:  # a dependency of parallax; only a broken environment lacks it
        raise ImportError("px.models.from_pretrained needs the safetensors package: "
                          "pip install safetensors") from None
    return safetensors


class CheckpointFiles:
    """The config and lazily opened tensors of one checkpoint directory.

    Args:
      path: the directory ``save_pretrained`` wrote (``config.json`` + safetensors).

    Example:
      >>> import json, tempfile, pathlib, numpy as np
      >>> from safetensors.numpy import save_file
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
      >>> save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, d / "model.safetensors")
      >>> files = CheckpointFiles(d)
      >>> files.read("w", (slice(1, 2), slice(0, 2))), files.bytes_read
      (array([[3., 4.]], dtype=float32), 8)
    """

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        config = self.path / "config.json"
        if not config.is_file():
            raise FileNotFoundError(
                f"px.models.from_pretrained: no config.json in {self.path}; pass the directory "
                "a Hugging Face save_pretrained (or px.models.save_pretrained) wrote.")
        self.config: dict = json.loads(config.read_text())
        self.weight_map = self._weight_map()
        self.bytes_read = 0
        self._open: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            weight_map = dict(json.loads(index.read_text())["weight_map"])
            self._check_shards(index, weight_map)
            return weight_map
        single = self.path / SINGLE
        if not single.is_file():
            found = sorted(p.name for p in self.path.iterdir())
            raise FileNotFoundError(
                f"px.models.from_pretrained: {self.path} has neither {SINGLE} nor {INDEX} "
                f"(found: {', '.join(found) or 'nothing'}); parallax reads safetensors only. "
                "To convert a PyTorch .bin checkpoint, load it with transformers and save it "
                "again: AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst) writes "
                "safetensors (transformers 5 always does; transformers 4 needs "
                "safe_serialization=True).")
        with _safetensors().safe_open(single, framework="numpy") as f:
            return {name: SINGLE for name in f.keys()}

    def _check_shards(self, index: pathlib.Path, weight_map: Mapping[str, str]) -> None:
        """Every shard the index names is on disk, or an error naming the index and shard."""
        for shard in sorted(set(weight_map.values())):
            if not (self.path / shard).is_file():
                held = sorted(name for name, file in weight_map.items() if file == shard)
                raise FileNotFoundError(
                    f"px.models.from_pretrained: {index} names the shard {shard!r} (holding "
                    f"{len(held)} tensors, e.g. {held[0]!r}), which is not in {self.path}; "
                    "the download or copy is incomplete: fetch the missing shard again.")

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def _file(self, name: str):
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = _safetensors().safe_open(self.path / file, framework="numpy")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Tensor ``name``, or the part ``index`` (one slice per dimension) of it."""
        lazy = self._file(name).get_slice(name)
        array = np.asarray(lazy[index] if index is not None else lazy[:])
        self.bytes_read += array.nbytes
        return array

    def close(self) -> None:
        self._open.clear()


def write_checkpoint(path: str | pathlib.Path, config: Mapping, tensors: Mapping[str, np.ndarray],
                     max_shard_bytes: int | None = None) -> None:
    """Writes ``config.json`` and the tensors as safetensors (shards + index past a size).

    The files carry ``{"format": "pt"}`` metadata, which ``transformers`` expects.
    """
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if max_shard_bytes and shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(array)
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], path / SINGLE, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map |= {name: file for name in shard}
    total = sum(a.nbytes for a in tensors.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                          "weight_map": weight_map}, indent=2))
