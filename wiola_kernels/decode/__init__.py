"""The CPU decoding kernels' Python side: thin, checked wrappers over the C++ extension's
decoding ops (``csrc/cpu/decode_*.cpp``, registered as ``wiola::_decode_*``).

* :mod:`~wiola_kernels.decode.gemv` — the batch-1 decoding GEMV, float32/bfloat16/float16
  weights read in place from ``nn.Linear.weight``;
* :mod:`~wiola_kernels.decode.attention` — a step's attention over a KV cache in one call
  (SRPE, the cache append, GQA softmax, the gated context slots);
* :mod:`~wiola_kernels.decode.block` — a whole Wiola block of such a step in one call;
* :mod:`~wiola_kernels.decode.step` — the whole step (embedding, every block, final norm,
  head) in one call.

The reference model (``python/wiola``) takes them where they apply (CPU, no gradients).
"""
