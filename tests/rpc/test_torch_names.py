"""parallax.rpc against torch.distributed.rpc itself (a test-only peer; skipped without torch):
the same defaults and constants, the same RRef and options methods, and every public torch
name in docs/rpc.md's table. Starts no process."""

import inspect
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[2]


def torch_rpc():
    pytest.importorskip("torch")
    import torch.distributed.rpc as rpc

    if not rpc.is_available():
        pytest.skip("this torch build has no torch.distributed.rpc")
    return rpc


def test_the_defaults_and_constants_are_torchs():
    theirs = torch_rpc()
    import parallax.rpc as rpc
    from parallax.rpc import options

    assert options.DEFAULT_RPC_TIMEOUT_SEC == theirs.constants.DEFAULT_RPC_TIMEOUT_SEC
    assert options.UNSET_RPC_TIMEOUT == theirs.constants.UNSET_RPC_TIMEOUT
    assert options.DEFAULT_NUM_WORKER_THREADS == theirs.constants.DEFAULT_NUM_WORKER_THREADS
    assert options.DEFAULT_SHUTDOWN_TIMEOUT == theirs.constants.DEFAULT_SHUTDOWN_TIMEOUT
    assert options.DEFAULT_INIT_METHOD == theirs.constants.DEFAULT_INIT_METHOD
    ours, torchs = rpc.TensorPipeRpcBackendOptions(), theirs.TensorPipeRpcBackendOptions()
    for name in ("num_worker_threads", "rpc_timeout", "init_method"):
        assert getattr(ours, name) == getattr(torchs, name), name
    assert [m.name for m in rpc.BackendType] == ["TENSORPIPE"]
    assert theirs.BackendType.TENSORPIPE.name == "TENSORPIPE"


def test_the_signatures_take_torchs_arguments_in_torchs_order():
    theirs = torch_rpc()
    import parallax.rpc as rpc

    for name in ("rpc_sync", "rpc_async", "remote", "shutdown", "get_worker_info"):
        want = list(inspect.signature(getattr(theirs, name)).parameters)
        got = list(inspect.signature(getattr(rpc, name)).parameters)
        assert got[:len(want)] == want, (name, got, want)
    want = ["name", "backend", "rank", "world_size", "rpc_backend_options"]
    assert list(inspect.signature(rpc.init_rpc).parameters)[:5] == want


def test_an_rref_has_every_public_method_of_torchs():
    theirs = torch_rpc()
    import parallax.rpc as rpc

    public = [n for n in dir(theirs.RRef) if not n.startswith("_")]
    assert public and [n for n in public if not hasattr(rpc.RRef, n)] == []


def test_docs_table_names_every_public_torch_name():
    theirs = torch_rpc()
    import torch.distributed.autograd as autograd

    text = (ROOT / "docs" / "rpc.md").read_text()
    table = text[text.index("## Every `torch.distributed.rpc` name"):
                 text.index("### The parameter idiom")]
    names = set(theirs.__all__) | {"get_rpc_timeout", "WorkerInfo", "RpcBackendOptions",
                                   "PyRRef", "enable_gil_profiling", "RemoteProfilerManager",
                                   "RpcAgent", "TensorPipeAgent"}
    names |= {n for n in ("context", "backward", "get_gradients", "is_available",
                          "DistAutogradContext") if hasattr(autograd, n)}
    missing = sorted(n for n in names if all(f"{c}{n}" not in table for c in "` .(,"))
    assert missing == [], f"docs/rpc.md's table lacks {missing}"
