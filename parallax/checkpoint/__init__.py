"""Checkpoints of sharded training state, on Orbax: save, restore under any layout, manage.

``save(directory, state, step=..., extra=...)`` writes a state from any mesh (each device
its own shards); ``restore(directory, like=..., mesh=..., strategy=...)`` reads it straight
into the layout a strategy gives on a mesh, which may be another strategy, another number of
devices, or one device; ``Manager`` saves every few steps, asynchronously and atomically,
and keeps the newest few. See ``docs/checkpoint.md``.

Example:
  >>> import tempfile, optax, parallax as px
  >>> from flax import nnx
  >>> make = lambda: px.TrainState.create(px.models.MLP(4, [8], 4, rngs=nnx.Rngs(0)),
  ...                                     optax.adam(1e-3))
  >>> state = px.init(make, px.make_mesh(data=8), px.FSDP("data"))
  >>> directory = tempfile.mkdtemp()
  >>> _ = px.checkpoint.save(directory, state, step=1)
  >>> px.checkpoint.restore(directory, like=make).step          # on one device
  1
"""

from parallax.checkpoint.manager import Manager as Manager
from parallax.checkpoint.restore import Restored as Restored
from parallax.checkpoint.restore import restore as restore
from parallax.checkpoint.save import save as save
from parallax.checkpoint.store import CheckpointNotFoundError as CheckpointNotFoundError

__all__ = ["CheckpointNotFoundError", "Manager", "Restored", "restore", "save"]
