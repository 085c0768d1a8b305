"""Integrations: Horovod (the stock optimizer's Compression API, our wrapper optimizer, the
elastic state handlers: only where Horovod imports), PyTorch DDP, FSDP2/HSDP and DiLoCo."""
