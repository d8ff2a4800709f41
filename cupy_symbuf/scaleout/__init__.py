"""Layer 6: scale-out: the hierarchical all-to-all across nodes (HierarchicalCommunicator).
"""
