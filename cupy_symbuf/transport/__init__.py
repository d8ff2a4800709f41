"""Layer 2: the transport: the symmetric buffer and arrays, topology, construction-time agreement, lifecycle, the
host and CUDA engines (kernel loading, status decoding, trace, adaptive work sharing), CUDA streams and the tuning
table.

Its seams: ``bootstrap`` (the Bootstrap interface every construction and close exchange goes through; mpi4py's
communicator implements it), ``base`` (the Transport protocols both engines implement) and ``engine`` (the Engine
the layers above reach through ``Communicator.engine``).
"""
