"""The built-in weight transports, registered through the same hook as any plugin's (no entry point needed)."""

from __future__ import annotations

from genengine.hookspecs import RegisterTransport, hookimpl


@hookimpl
def register_weight_transports(register: RegisterTransport) -> None:
    register(
        "gloo",
        "genengine.transport.broadcast:GlooTransport",
        description="CPU tensors broadcast over gloo from the trainer to every replica",
    )
    register(
        "nccl",
        "genengine.transport.broadcast:NcclTransport",
        description="CUDA tensors broadcast over NCCL from the trainer's GPU to every replica's (one GPU each)",
    )
    register(
        "cuda_ipc",
        "genengine.transport.cuda_ipc:CudaIpcTransport",
        description="trainer and replicas on one GPU: buckets shared through CUDA IPC handles",
    )
