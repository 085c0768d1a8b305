from hvd_compress.compressors.acpsgd import ACPSGD
from hvd_compress.compressors.base import Compressor
from hvd_compress.compressors.cast import BF16, FP16, NoCompression
from hvd_compress.compressors.chunked_topk import ChunkedTopK
from hvd_compress.compressors.powersgd import PowerSGD
from hvd_compress.compressors.qallreduce import QuantizedAllReduce
from hvd_compress.compressors.qsgd import QSGD
from hvd_compress.compressors.scalecom import ScaleCom
from hvd_compress.compressors.signsgd import SignSGD
from hvd_compress.compressors.topk import TopK

__all__ = [
    "ACPSGD",
    "BF16",
    "ChunkedTopK",
    "Compressor",
    "FP16",
    "NoCompression",
    "PowerSGD",
    "QSGD",
    "QuantizedAllReduce",
    "ScaleCom",
    "SignSGD",
    "TopK",
]
