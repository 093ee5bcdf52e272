"""Decode-specialised Pallas paged attention (one query per row) with flash-decoding split-K."""

from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention
from pallas_kernels.paged_decode_attention.reference import paged_decode_attention_reference

__all__ = ["paged_decode_attention", "paged_decode_attention_reference"]
