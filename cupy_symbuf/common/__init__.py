"""Layer 1: what every layer above shares: errors, Config, the dtype table, the optional CuPy backend, logging,
the one module of argument checks and the one of array addresses.
"""
