"""``ShardedVariable``: a variable split along axis 0 into shards living on parameter servers.

Each shard's rows are keys on one server (:mod:`parallax.tf.parameter_server.key_layout`).
A worker reads the whole variable (``read``, ``numpy``, ``np.asarray(v)``, an operator, as
TensorFlow reads a variable used as a tensor; JAX functions take arrays, so
``jnp.matmul(x, np.asarray(v))``), updates it on the servers (``assign``, ``assign_add``,
``assign_sub``: atomic on each server, the optimizer's state untouched), pushes a dense
gradient (``apply_gradient``: the servers' optimizer applies it), or, for an embedding
table, pulls only the rows a batch touches (``lookup``) and pushes only their gradients
(``apply_sparse_gradient``). ``variables`` lists the shards (TensorFlow's ``w/part_0``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import jax.numpy as jnp

from parallax.ps import ADD, ASSIGN, UPDATE, HandleError
from parallax.tf.parameter_server.key_layout import KeyLayout, Shard
from parallax.tf.parameter_server.missing_optimizer import MissingOptimizerError


def _bucket(count: int) -> int:
    """Rows padded to a power of two (at least 8): jit compiles few shapes, not one per batch."""
    return max(8, 1 << max(0, count - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class SparseRows:
    """The rows of a table one batch touches, pulled from the servers.

    Attributes:
      ids: the distinct row ids, sorted (``count`` of them).
      values: ``[bucket, row_width]`` rows for those ids, zero-padded past ``count`` to a
        power of two so that a jitted step sees few shapes.
      inverse: for each id of the batch (its shape), its row in ``values``:
        ``values[inverse]`` is the batch's embeddings (``gather``).
      count: how many rows are real.

    Example:
      >>> rows = SparseRows(np.array([3, 9]), np.arange(16.0).reshape(8, 2), np.array([1, 0, 1]), 2)
      >>> rows.gather().tolist()
      [[2.0, 3.0], [0.0, 1.0], [2.0, 3.0]]

    References:
      TensorFlow, ``tf.nn.embedding_lookup`` on a ``ShardedVariable`` and ``tf.IndexedSlices``.
    """

    ids: np.ndarray
    values: np.ndarray
    inverse: np.ndarray
    count: int

    def gather(self, values=None):
        """``values[inverse]``: the batch's rows (``values`` defaults to the pulled rows;
        pass updated or traced rows, e.g. inside ``jax.jit``)."""
        return (self.values if values is None else values)[self.inverse]


class ShardedVariable:
    """A variable whose rows are split into shards on the parameter servers.

    Created by :meth:`parallax.tf.ParameterServerStrategy.create_variable` (or for every
    parameter of a model by ``distribute_model``). It pickles, so scheduled functions can
    use it on workers; each process talks to the servers through its own client.

    Attributes:
      name: the variable's name.
      shape: its full shape (axis 0 is split).
      dtype: float32 (what the servers store).
      shards: the :class:`~parallax.tf.parameter_server.key_layout.Shard` list, in row order.
      slot: None for the variable itself, ``i`` for the optimizer's ``i``-th per-element
        state (read-only).

    Example:
      >>> import numpy as np, optax, parallax as px
      >>> strategy = px.tf.ParameterServerStrategy(
      ...     px.tf.RayClusterResolver(num_workers=1, num_ps=1),
      ...     variable_partitioner=px.tf.FixedShardsPartitioner(2))
      >>> strategy.set_optimizer(optax.sgd(1.0))
      >>> table = strategy.create_variable(np.arange(12.0).reshape(6, 2), name="table")
      >>> [s.rows for s in table.shards]
      [3, 3]
      >>> rows = table.lookup(np.array([4, 1, 4]))
      >>> rows.ids.tolist(), rows.gather().tolist()
      ([1, 4], [[8.0, 9.0], [2.0, 3.0], [8.0, 9.0]])
      >>> table.apply_sparse_gradient(rows, np.ones((rows.count, 2)))   # sgd(1.0): rows - 1
      >>> table.read()[[1, 4]].tolist()
      [[1.0, 2.0], [7.0, 8.0]]
      >>> strategy.shutdown()

    References:
      TensorFlow, ``tf.distribute.ShardedVariable`` and ``ParameterServerStrategy``'s
      variable partitioning; Li et al., OSDI 2014 (sparse pulls and pushes).
    """

    def __init__(self, name: str, shape: tuple[int, ...], shards: tuple[Shard, ...], store,
                 slot: int | None = None):
        self.name, self.shape, self.shards, self.slot = name, tuple(shape), tuple(shards), slot
        self.dtype = np.dtype(np.float32)
        self._store = store
        self._layout = KeyLayout([self])
        self._client = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_client"] = None  # each process opens its own
        return state

    @property
    def row_width(self) -> int:
        """Elements per row (``prod(shape[1:])``, 1 for vectors and scalars)."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def optimizer_slot(self, slot: int) -> ShardedVariable:
        """The optimizer's ``slot``-th per-element state for this variable (e.g. Adam's ``mu``)."""
        return ShardedVariable(f"{self.name}/slot{slot}", self.shape, self.shards, self._store,
                               slot=slot)

    @property
    def variables(self) -> list[ShardedVariable]:
        """The shards, each a one-shard variable (TensorFlow's ``ShardedVariable.variables``)."""
        if len(self.shards) == 1 and self.shards[0].row_start == 0:
            return [self]
        return [ShardedVariable(f"{self.name}/part_{i}", (s.rows,) + self.shape[1:],
                                (dataclasses.replace(s, row_start=0),), self._store, self.slot)
                for i, s in enumerate(self.shards)]

    @property
    def device(self) -> str:
        """The parameter server holding a one-shard variable, as TensorFlow names it."""
        if len(self.shards) != 1:
            raise AttributeError(f"ShardedVariable {self.name!r} has {len(self.shards)} shards "
                                 f"on their own servers: read each shard's "
                                 f"{self.name}.variables[i].device.")
        return f"/job:ps/replica:0/task:{self.shards[0].server}/device:CPU:0"

    # -- dense -----------------------------------------------------------------------------

    def read(self) -> np.ndarray:
        """The whole value, pulled from every shard (TensorFlow's ``read_value``)."""
        client = self.client()
        return self._layout.split(client.wait(client.pull(self._layout.keys, slot=self.slot)))[0]

    numpy = read_value = value = read

    def __iter__(self):
        raise TypeError(f"ShardedVariable {self.name!r} is not iterable (as TensorFlow's); "
                        f"iterate over np.asarray(variable) or variable.variables.")

    def __array__(self, dtype=None, copy=None):
        """``np.asarray(v)``: the value (TensorFlow's ``tf.convert_to_tensor(v)``)."""
        del copy  # a pull is always a fresh array
        return self.read() if dtype is None else self.read().astype(dtype)

    def assign(self, value) -> ShardedVariable:
        """Overwrites the value (and resets the optimizer's per-element state of it)."""
        self._push(self._layout.join([self._checked("assign", value)]), ASSIGN)
        return self

    def assign_add(self, delta) -> ShardedVariable:
        """Adds ``delta`` on the servers (atomic on each; the optimizer's state is kept)."""
        self._push(self._layout.join([self._checked("assign_add", delta, "delta")]), ADD)
        return self

    def assign_sub(self, delta) -> ShardedVariable:
        """Subtracts ``delta`` on the servers (TensorFlow's ``assign_sub``, as ``assign_add``)."""
        self._push(self._layout.join([-self._checked("assign_sub", delta, "delta")]), ADD)
        return self

    def apply_gradient(self, grad) -> None:
        """Pushes a dense gradient; the servers' optimizer updates every shard."""
        self._push(self._layout.join([self._checked("apply_gradient", grad, "gradient")]),
                   UPDATE)

    # -- sparse (embedding tables) -----------------------------------------------------------

    def lookup(self, ids) -> SparseRows:
        """Pulls only the rows ``ids`` names (each distinct row once).

        Args:
          ids: integer row ids of any shape (a batch of users, items, tokens).

        Returns:
          :class:`SparseRows`; ``rows.gather()`` has shape
          ``ids.shape + (row_width,)``.
        """
        ids = np.asarray(ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ShardedVariable.lookup: ids must be integers, got {ids.dtype}.")
        unique, inverse = np.unique(ids, return_inverse=True)
        if unique.size and (unique[0] < 0 or unique[-1] >= self.rows):
            bad = unique[0] if unique[0] < 0 else unique[-1]
            raise ValueError(f"ShardedVariable.lookup: id {bad} is outside {self.name!r}'s "
                             f"{self.rows} rows [0, {self.rows}).")
        keys, order = self._row_keys(unique)
        client = self.client()
        pulled = client.wait(client.pull(keys, slot=self.slot)).reshape(-1, self.row_width)
        values = np.zeros((_bucket(unique.size), self.row_width), np.float32)
        values[:unique.size] = pulled[order]
        return SparseRows(unique, values, inverse.reshape(ids.shape).astype(np.int32),
                          int(unique.size))

    def apply_sparse_gradient(self, rows: SparseRows, grads) -> None:
        """Pushes the gradients of ``rows`` (``[count or bucket, row_width]``) only."""
        grads = np.asarray(grads, np.float32).reshape(-1, self.row_width)[:rows.count]
        if grads.shape[0] != rows.count:
            raise ValueError(f"ShardedVariable.apply_sparse_gradient: {rows.count} rows were "
                             f"looked up but {grads.shape[0]} gradient rows were given.")
        keys, order = self._row_keys(rows.ids)
        sorted_grads = np.empty_like(grads)
        sorted_grads[order] = grads  # undo: keys are sorted, ids need not be in key order
        client = self.client()
        client.wait(client.push(keys, sorted_grads.reshape(-1), cmd=UPDATE))

    # -- internals ---------------------------------------------------------------------------

    def client(self):
        """This process's connection to the servers."""
        if self._client is None:
            self._client = self._store.client()
        return self._client

    def _row_keys(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sorted keys of rows ``ids``, where each id's row lands in key order)."""
        starts = np.array([s.row_start for s in self.shards], np.int64)
        first = np.array([s.first_key for s in self.shards], np.uint64)
        shard = np.searchsorted(starts, ids, side="right") - 1
        keys = first[shard] + (ids - starts[shard]).astype(np.uint64)
        sort = np.argsort(keys, kind="stable")
        order = np.empty_like(sort)
        order[sort] = np.arange(sort.size)  # id i's row is reply row order[i]
        return keys[sort], order

    def _checked(self, api: str, value, what: str = "value") -> np.ndarray:
        value = np.asarray(value, np.float32)
        if value.shape != self.shape:
            raise ValueError(f"ShardedVariable.{api}: {self.name!r} has shape {self.shape}, "
                             f"got a {what} of shape {value.shape}.")
        return value

    def _push(self, flat: np.ndarray, cmd: int) -> None:
        if self.slot is not None:
            raise ValueError(f"ShardedVariable: {self.name!r} is an optimizer slot, read-only.")
        self.push_flat(self._layout.keys, flat, self._layout.lens, cmd)

    def push_flat(self, keys, flat, lens, cmd: int) -> None:
        """Pushes ``flat`` (in key order) to ``keys`` through this process's client.

        Raises:
          ValueError: a gradient reached servers that have no optimizer (the reason and
            the fixes, instead of the servers' ``HandleError``).
        """
        client = self.client()
        try:
            client.wait(client.push(keys, flat, lens, cmd=cmd))
        except HandleError as error:
            if isinstance(error.__cause__, MissingOptimizerError):
                raise MissingOptimizerError(f"ShardedVariable {self.name!r}: "
                                            f"{error.__cause__}") from None
            raise

    def __repr__(self) -> str:
        return (f"ShardedVariable({self.name!r}, shape={self.shape}, shards="
                f"{[(s.rows, s.server) for s in self.shards]})")


def _read_then(operator: str):
    """TensorFlow's operator on a variable: read the value, then apply the array's."""
    def apply(variable: ShardedVariable, *args):
        return getattr(jnp.asarray(variable.read()), operator)(*args)
    apply.__name__ = operator
    return apply


# TensorFlow's ShardedVariable overloads the tensor operators (reading its value); so does
# this one (not == and !=, which keep identity: variables are dictionary keys).
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"):
    for _operator in (f"__{_name}__", f"__r{_name}__"):
        setattr(ShardedVariable, _operator, _read_then(_operator))
for _operator in ("__neg__", "__pos__", "__abs__", "__getitem__", "__lt__", "__le__", "__gt__",
                  "__ge__"):
    setattr(ShardedVariable, _operator, _read_then(_operator))
