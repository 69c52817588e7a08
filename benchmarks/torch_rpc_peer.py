"""One non-zero rank of the torch.distributed.rpc (TensorPipe) group that ``benchmarks/rpc.py``
times parallax.rpc against: imports torch, says ``ready``, waits for ``go`` on stdin, then
``init_rpc`` (printing the seconds it took) and a graceful ``shutdown`` (which waits for
the other ranks' calls). Rank 0 runs here too when the init_rpc rounds are timed: torch keys
a process's rendezvous by how many times it called ``init_rpc``, so each round needs fresh
processes.

    python benchmarks/torch_rpc_peer.py RANK WORLD_SIZE PORT

torch is a test-only peer (never a parallax dependency). Everything listens on 127.0.0.1.
"""

import os
import sys
import time
import warnings

os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # TensorPipe's listeners on loopback
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch.distributed.rpc as rpc  # noqa: E402

warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's own, harmless


def main():
    rank, world_size, port = map(int, sys.argv[1:4])
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                              num_worker_threads=16)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options)
    print(f"init {time.perf_counter() - start}", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
