"""Layer 3: collectives over the engine: alltoall / alltoallv paths, the quantised wire (fp8 / int8) and
DeltaExchange.
"""
