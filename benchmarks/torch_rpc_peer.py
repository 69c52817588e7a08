"""One non-zero rank of the torch.distributed.rpc (TensorPipe) group that ``benchmarks/rpc.py``
times parallax.rpc against: imports torch, says ``ready``, waits for ``go`` on stdin, then
``init_rpc`` and a graceful ``shutdown`` (which waits for rank 0's calls).

    python benchmarks/torch_rpc_peer.py RANK WORLD_SIZE PORT

torch is a test-only peer (never a parallax dependency). Everything listens on 127.0.0.1.
"""

import os
import sys

os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # TensorPipe's listeners on loopback
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch.distributed.rpc as rpc  # noqa: E402


def main():
    rank, world_size, port = map(int, sys.argv[1:4])
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                              num_worker_threads=16)
    print("ready", flush=True)
    sys.stdin.readline()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options)
    rpc.shutdown()


if __name__ == "__main__":
    main()
