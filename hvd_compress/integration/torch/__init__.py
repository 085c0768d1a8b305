"""torch.distributed alone: DDP's comm hook (``ddp.py``), FSDP2/HSDP's replicate exchange
(``fsdp.py``) and DiLoCo's outer loop (``diloco.py``, under Horovod too)."""
