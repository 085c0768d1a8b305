"""torch.distributed alone: DDP's comm hook (``ddp.py``), FSDP2/HSDP's replicate exchange
(``fsdp.py``) and DiLoCo with the methods built on it (``diloco/``, under Horovod too)."""
