"""``@px.train_step``: the user's step as one jitted SPMD program, its state and batch laid
out by the strategy, its failures explained at the boundary."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from parallax.step import batch as batch_lib
from parallax import attention_kernel, context, host_memory, layout, loss_scale
from parallax import finite_check
from parallax.step import boundary_checks
from parallax.mesh import describe
from parallax.step.placement import checked_strategy
from parallax.state import TrainState
from parallax.strategy import Strategy


class TrainStep:
    """A user's ``step(state, batch, *args) -> (state, metrics)``, jitted for a mesh.

    Calling it runs one ``jax.jit``-ed SPMD program: the state keeps the layout it was
    created in (``px.init``) and comes back in the strategy's layout, donated (updated in
    place); the batch is split over the strategy's batch axes. ``lower(...)`` returns
    ``jax.jit``'s ``Lowered`` so the compiled program can be inspected
    (``.compile().as_text()``, ``.memory_analysis()``); ``compile(...)`` returns the
    compiled program and the calls that fit it then run it, compiled once.

    A call costs what ``jax.jit``'s dispatch costs and almost nothing of parallax's own: the
    jitted function is built once, ``jax.jit``'s C++ cache keys each call on the arguments'
    tree structure, shapes, dtypes and shardings, and parallax's checks (the batch against
    the strategy, the returned state's structure) and layout run while ``jit`` traces, that
    is only when a new signature makes it retrace. Before a call, one O(1) check refuses a
    state donated to an earlier call (its buffers are deleted); after ``jit`` fails, the
    checks of :mod:`parallax.step.boundary_checks` replace JAX's message where they know better.
    """

    def __init__(self, fn: Callable, mesh: Mesh, strategy: Strategy, donate: bool,
                 check_finite: bool = False, attention: str = "auto"):
        boundary_checks.check_step_fn(fn)
        self.fn, self.mesh, self.strategy, self.donate = fn, mesh, strategy, donate
        self.check_finite = check_finite
        self.attention = attention_kernel.check_kernel(attention, "px.train_step")
        self._context = context.StepContext(mesh, strategy, attention=self.attention)
        self._multiprocess = jax.process_count() > 1
        self._local_signature = None  # this process's batch shapes, last checked
        self._donated = None  # the last state donated: its buffers are deleted
        self._last_shapes: dict | None = None  # the batch's shapes at the last good trace
        self._compiled = None  # the program compile() made: calls that fit it run it
        # The state keeps its own (committed) shardings on the way in, and is constrained to
        # the strategy's layout on the way out; every batch leaf gets the one batch sharding.
        self._jitted = jax.jit(
            self._named_traced(),
            in_shardings=(None, batch_lib.batch_sharding(strategy, mesh)),
            donate_argnums=(0,) if donate else (),
        )
        functools.update_wrapper(self, fn)

    def state_shardings(self, state):
        """The ``NamedSharding`` of every leaf of ``state`` under the strategy."""
        return layout.state_shardings(state, self.strategy, self.mesh, "px.train_step")

    def _named_traced(self) -> Callable:
        """:meth:`_traced` under the user's function's name, which the compiled program and
        profiles then show (``jit(train)``, not an internal name)."""

        def traced(state, batch, *args):
            return self._traced(state, batch, *args)

        traced.__name__ = traced.__qualname__ = getattr(self.fn, "__name__", "step")
        return traced

    def _traced(self, state, batch, *args):
        """The step as ``jit`` traces it: checks, the strategy's context, the layout."""
        self._check(batch)
        state_sh = self.state_shardings(state)
        state = self._fetched(state)
        with context.activate(self._context), loss_scale.scale_of(state), \
                finite_check.scope(self.check_finite) as records:
            finite_check.record("batch ", batch)
            out = self.fn(state, batch, *args)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"px.train_step: {getattr(self.fn, '__name__', 'the step')} must "
                f"return (state, metrics); it returned {type(out).__name__}."
            )
        new_state, metrics = out
        if jax.tree.structure(new_state) != jax.tree.structure(state):
            raise TypeError(
                "px.train_step: the state returned by the step has a different "
                f"structure from the state passed in:\n  in:  {jax.tree.structure(state)}\n  "
                f"out: {jax.tree.structure(new_state)}"
            )
        self._last_shapes = boundary_checks.batch_shapes(batch)
        new_state = jax.lax.with_sharding_constraint(new_state, state_sh)
        new_state = host_memory.to_host(new_state, state_sh)
        if not self.check_finite:
            return new_state, metrics
        # Numbered names keep the recording order through jit's sorted dict keys.
        return new_state, metrics, {f"{i:05d} {name}": ok for i, (name, ok) in enumerate(records)}

    @staticmethod
    def _fetched(state):
        """``state`` with its leaves in host memory (ZeRO-Offload) copied to the device; a
        ``px.TrainState``'s optimizer state stays there until ``apply_gradients`` fetches
        it, after the gradients (:mod:`parallax.host_memory`)."""
        if isinstance(state, TrainState):
            return state.replace(params=host_memory.to_device(state.params),
                                 rest=host_memory.to_device(state.rest))
        return host_memory.to_device(state)

    def __call__(self, state, batch, *args):
        if state is self._donated or (type(state) is TrainState and state.step.is_deleted()):
            raise boundary_checks.donated_error()
        if self._multiprocess:
            batch = self._assemble(batch)
        try:
            out = self._run_compiled(state, batch, *args)
            if out is None:
                with jax.set_mesh(self.mesh):
                    out = self._jitted(state, batch, *args)
        except (TypeError, ValueError) as error:
            # jit checks the arguments against their shardings before tracing, with
            # messages about pjit; parallax's own checks say what is wrong and the fix.
            self._explain(state, batch, error)
            raise
        if self.donate and out[0] is not state:  # a real program returns new buffers
            self._donated = state
        return self._finite(out) if self.check_finite else out

    def _run_compiled(self, state, batch, *args):
        """The outputs of the program :meth:`compile` made, or None when the arguments do
        not fit it (other shapes, dtypes, shardings or structure: jax checks them before
        running anything, so nothing is donated), and ``jit``'s path runs instead."""
        if self._compiled is None:
            return None
        try:
            return self._compiled(state, batch, *args)
        except (TypeError, ValueError):
            return None

    def _assemble(self, batch):
        """The global batch from this process's share. The processes' shapes are compared
        (one small all-gather) on the first call and whenever this process's shapes change:
        every process then checks, as long as they change their shapes together."""
        signature = batch_lib.local_signature(batch)
        batch = batch_lib.assemble(batch, self.strategy, self.mesh,
                                   check=signature != self._local_signature)
        self._local_signature = signature
        return batch

    def _explain(self, state, batch, error) -> None:
        """The checks that run at trace time or only on the error path of a call."""
        self._check(batch)
        boundary_checks.check_state_mesh(state, self.mesh)
        boundary_checks.explain_failure(batch, error, self._last_shapes)

    def _check(self, batch) -> None:
        """The checks that run at trace time, for errors ``jit`` raises before tracing."""
        batch_lib.check_batch(batch, self.strategy, self.mesh, "px.train_step")

    def _finite(self, out):
        """``check_finite``: raises naming the first record that failed."""
        new_state, metrics, report = out
        report = {name.split(" ", 1)[1]: bool(ok) for name, ok in
                  sorted(jax.device_get(report).items())}
        failed = finite_check.first_failure(report)
        if failed is not None:
            raise ValueError(
                f"px.train_step(check_finite=True): {failed} is not finite (or its check "
                "failed): the values after it (loss, gradients, the new state) are not to "
                "be trusted. Checked in order: the batch, the model's checks, the loss, the "
                "gradients." + (" The input state was donated; decorate with donate=False "
                                "to keep it." if self.donate else ""))
        return new_state, metrics

    def lower(self, state, batch, *args, platforms: tuple[str, ...] | None = None):
        """``jax.jit(...).lower``: the program this step runs, before compilation.

        The state's shardings are the strategy's here (not the arguments' own), so an
        abstract state (``jax.ShapeDtypeStruct`` without shardings) lowers to the program a
        real call runs. ``platforms`` (e.g. ``("cuda",)``) lowers it for another backend
        instead (``jax.stages.Traced.lower(lowering_platforms=...)``): the program a GPU
        would run, readable (``as_text()``) on a machine without one, not compilable there.
        """
        if self._multiprocess:
            batch = batch_lib.assemble(batch, self.strategy, self.mesh)
        state_sh = self.state_shardings(state)
        # jit's in_shardings do not type a tracer's memory space; an abstract leaf carrying
        # its sharding does: ZeRO-Offload's host leaves then lower with their transfers.
        state = jax.tree.map(lambda x, sh: x if isinstance(x, jax.Array) else
                             jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, state_sh)
        jitted = jax.jit(
            self._named_traced(),
            in_shardings=(state_sh, batch_lib.batch_sharding(self.strategy, self.mesh)),
            donate_argnums=(0,) if self.donate else (),
        )
        with jax.set_mesh(self.mesh):
            if platforms is None:
                return jitted.lower(state, batch, *args)
            return jitted.trace(state, batch, *args).lower(lowering_platforms=tuple(platforms))

    def compile(self, state, batch, *args, compiler_options: dict | None = None):
        """``lower(...).compile()``, and the step's later calls on arguments of the same
        shapes, dtypes and shardings run this program instead of compiling it again.

        ``lower(...).compile()`` alone gives the same program, but jax keeps it apart from
        the cache a call uses, so the first call would compile it a second time: use this
        to inspect the compiled program (``memory_analysis()``, its HLO) and then train.
        ``compiler_options`` are XLA's, for this program only (``jax.jit``'s), e.g.
        ``{"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}`` (see
        ``docs/performance.md, "The gradient sync across processes"``).
        """
        self._compiled = self.lower(state, batch, *args).compile(compiler_options)
        return self._compiled

    def __repr__(self) -> str:
        return (f"px.train_step({getattr(self.fn, '__name__', 'step')}, "
                f"mesh={describe(self.mesh)}, strategy={self.strategy.name})")


def train_step(mesh: Mesh, strategy: Strategy | None = None, *, donate: bool = True,
               check_finite: bool = False, attention: str = "auto"):
    """Decorates ``step(state, batch, *args) -> (state, metrics)`` as a jitted SPMD step.

    Inside the step the strategy is active: ``px.value_and_grad`` produces and synchronises
    gradients as it says, and ``px.constrain`` resolves activation names through its rules.

    Args:
      mesh: the device mesh.
      strategy: how to lay out state and batch and synchronise gradients; replicated when
        None.
      donate: donate the input state's buffers to the output (the default; the old state
        must not be used after the call: passing it again is an error).
      check_finite: after each call, raise naming the first non-finite value among the
        batch, the model's checks (the reference GPT's token ids), the loss and the
        gradients of ``px.value_and_grad`` (see :mod:`parallax.finite_check`). Off by default:
        it waits for every step to finish.
      attention: the kernel of ``parallax.attention.dot_product_attention`` (the models'
        attention) in this step: ``"auto"`` (cuDNN's fused attention on NVIDIA GPUs in
        bfloat16/float16, Pallas' splash attention on TPUs, else XLA;
        :mod:`parallax.attention_kernel`), or ``"xla"``, ``"cudnn"``, ``"pallas"`` to force
        one (an error where it cannot run). ``px.explain`` shows which one the program runs.

    Returns:
      A decorator producing a :class:`TrainStep`.

    Example:
      >>> import jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> mesh, strategy = px.make_mesh(data=-1), px.DataParallel("data")
      >>> state = px.init(lambda: px.TrainState.create(
      ...     px.models.MLP(4, [8], 2, rngs=nnx.Rngs(0)), optax.sgd(0.1)), mesh, strategy)
      >>> @px.train_step(mesh, strategy)
      ... def step(state, batch):
      ...     loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
      ...     return state.apply_gradients(grads), {"loss": loss}
      >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.zeros((16, 2))}
      >>> state, metrics = step(state, batch)
    """
    strategy = checked_strategy(strategy, mesh, "px.train_step")
    attention_kernel.check_kernel(attention, "px.train_step")

    def decorator(fn: Callable) -> TrainStep:
        return TrainStep(fn, mesh, strategy, donate, check_finite, attention)

    return decorator
