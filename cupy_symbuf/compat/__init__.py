"""Layer 7: compatibility faces: a DeepEP-shaped module over cupy_symbuf.
"""
