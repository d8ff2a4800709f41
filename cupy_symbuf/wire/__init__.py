"""Layer 0: the wire protocol: constants shared by Python and CUDA, the channel layout (the buffer map) and the
exchange plan. Pure Python: no CuPy, no MPI.
"""
