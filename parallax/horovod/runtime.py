"""``hvd.init()``, ``hvd.shutdown()``, ``hvd.is_initialized()``: px.distributed under Horovod's
names (``rank``, ``size``, ``local_rank``, ``local_size`` are px.distributed's own)."""

from __future__ import annotations

from parallax.distributed import runtime


def init(comm=None) -> None:
    """Joins the job (``px.distributed.initialize()``; launched with ``parallax launch``).

    Args:
      comm: Horovod's MPI communicator argument; not supported (JAX's coordinator decides).

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.init()
      >>> hvd.is_initialized()
      True

    References:
      Horovod ``hvd.init()``.
    """
    if comm is not None:
        raise ValueError("hvd.init: comm= (an MPI communicator) is not supported; the ranks are "
                         "the processes of the jax.distributed job (parallax launch -np N).")
    runtime.initialize()


def is_initialized() -> bool:
    """True once :func:`init` ran in this process.

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.init(); hvd.is_initialized()
      True
    """
    return runtime.joined() is not None


def shutdown() -> None:
    """Leaves the job in step with the other ranks (``px.distributed.shutdown()``).

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.shutdown()
    """
    runtime.shutdown()


def mpi_threads_supported() -> bool:
    """False: there is no MPI here (JAX's coordinator and XLA's collectives)."""
    return False


def mpi_enabled() -> bool:
    """False: no MPI (Horovod's ``mpi_enabled``)."""
    return False


def mpi_built() -> bool:
    """False: no MPI (Horovod's ``mpi_built``)."""
    return False


def gloo_enabled() -> bool:
    """True on CPU, where XLA's cross-process collectives are gloo's.

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.gloo_enabled()
      True
    """
    import jax
    return jax.default_backend() == "cpu"


def nccl_built() -> bool:
    """True on GPU, where XLA's collectives are NCCL's (Horovod's ``nccl_built``)."""
    import jax
    return jax.default_backend() == "gpu"
