"""Tensor parallelism of the target over torch.distributed (docs/ARCHITECTURE.md, "Tensor parallel target")."""
