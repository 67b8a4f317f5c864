"""What happens to a request's KV cache while its API call runs."""

from enum import Enum


class Strategy(str, Enum):
    PRESERVE = "preserve"  # blocks stay on the device
    DISCARD = "discard"  # blocks are freed; the context is recomputed on return
    SWAP = "swap"  # blocks are copied to host memory and back
