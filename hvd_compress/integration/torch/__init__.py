"""torch.distributed alone: DDP's comm hook (``ddp.py``), FSDP2's compressed exchange (``fsdp/``:
HSDP's replicate all-reduce, pure FSDP's reduce-scatter) and DiLoCo with the methods built on it
(``diloco/``, under Horovod too)."""
