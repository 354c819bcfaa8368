"""The torch.distributed family: ``gloo`` (CPU) and ``torch-nccl`` (CUDA), one transport between them."""
