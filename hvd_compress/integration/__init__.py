"""Integration with Horovod: the stock optimizer's Compression API and our wrapper optimizer."""
