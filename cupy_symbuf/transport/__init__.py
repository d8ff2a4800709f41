"""Layer 2: the transport: the symmetric buffer and arrays, topology, construction-time agreement, lifecycle, the
host and CUDA engines (kernel loading, status decoding, trace, adaptive work sharing), CUDA streams and the tuning
table.
"""
